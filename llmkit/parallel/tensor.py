"""Tensor parallelism (Megatron-LM's layout, with sequence parallelism) on DTensor.

Each model component declares its own plan: a method ``tensor_parallel_plan(self, tp)``
returning ``{submodule path: ParallelStyle}`` relative to itself (``""`` is the component
itself), the styles being torch's (``torch.distributed.tensor.parallel``) or this module's
short names for them. :func:`parallelize_transformer` asks every component of a
:class:`~llmkit.model.transformer.Transformer` for its plan and applies it; a component
without the method is refused by name (one line), so a plugin's attention or ffn gets tensor
parallelism by declaring a plan beside its code, without a fork.

Between layers the residual stream is split along the sequence (``Shard(1)``: sequence
parallelism, Korthikanti et al. 2022): norms (and the block's residual adds) act on each
rank's tokens. The model gathers the sequence before the attention and the ffn and each of
them returns its output reduce-scattered back (:func:`row`), so:

- **ffn** plans split the hidden dimension: ``{"in_proj": column(), "out_proj": row()}``;
- **attention kernels** see the rank's heads only and have no weights to split: ``{}``;
- **norms** are sequence-parallel: ``{"": sequence()}``;
- **blocks** without weights of their own: ``{}``; q/k transforms: :class:`HeadShards`;
- **positional schemes** act before the sequence is split (``embed``) or on the rank's heads
  (``rotate``, ``score_bias``, which the attention module slices): ``{}``.

The attention module's fused q/k/v projection is reordered once into key/value-head groups
(each group's query heads, then its key and its value head) so that a row split gives every
rank whole groups (GQA and MHA; ``tp`` must divide ``n_kv_heads``); checkpoints are written
in the model's own order (:class:`CanonicalOrder` converts). The embedding and the output
head split the vocabulary; the cross-entropy is computed on the split logits
(``loss_parallel``), never gathering them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from llmkit.errors import LlmkitError

__all__ = [
    "CanonicalOrder",
    "HeadShards",
    "column",
    "parallelize_transformer",
    "row",
    "sequence",
]


def column() -> Any:
    """A linear layer whose output features are split (input whole on every rank)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel()


def row() -> Any:
    """A linear layer whose input features are split; its partial outputs are summed and
    scattered back along the sequence (the sequence-parallel residual)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(output_layouts=Shard(1))


def sequence() -> Any:
    """A module acting token by token on the rank's part of the sequence, its weights whole
    on every rank (their gradients summed over ranks): norms."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return SequenceParallel(use_local_output=True)


def check_divides(what: str, size: int, tp: int) -> None:
    """One line when ``tp`` ranks cannot split ``size`` evenly (a plan's precondition)."""
    if size % tp:
        raise LlmkitError(
            f"{what} = {size} is not a multiple of train.parallel.tp = {tp} "
            "(tensor parallelism splits it evenly)"
        )


def _head_shards_style() -> type:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class _HeadShards(ParallelStyle):
        """Weights whole on every rank, every tensor input the rank's heads (dim 1 of
        (B, H, T, D)): for a q/k transform acting per head (QK-norm)."""

        def _apply(self, module: nn.Module, mesh: Any) -> nn.Module:
            def inputs(_mod: nn.Module, args: tuple[Any, ...], _mesh: Any) -> tuple[Any, ...]:
                return tuple(
                    DTensor.from_local(a, mesh, [Shard(1)], run_check=False)
                    if isinstance(a, Tensor) and not isinstance(a, DTensor)
                    else a
                    for a in args
                )

            def outputs(_mod: nn.Module, out: Any, _mesh: Any) -> Any:
                if isinstance(out, tuple):
                    return tuple(o.to_local() if isinstance(o, DTensor) else o for o in out)
                return out.to_local() if isinstance(out, DTensor) else out

            def replicate(_name: str, mod: nn.Module, dmesh: Any) -> None:
                for key, p in list(mod.named_parameters(recurse=False)):
                    dist = nn.Parameter(DTensor.from_local(p.data, dmesh, [Replicate()]))
                    mod.register_parameter(key, dist)

            return distribute_module(module, mesh, replicate, inputs, outputs)

    return _HeadShards


def HeadShards() -> Any:
    """The style of a module acting on the rank's attention heads with whole weights."""
    return _head_shards_style()()


# -- the fused q/k/v projection's order ------------------------------------------------------


def grouped_rows(heads: int, kv_heads: int, head_dim: int) -> Tensor:
    """Indices into the fused projection's rows (q heads, then k heads, then v heads) that
    put them in key/value-head groups: for each group, its query heads, its key head, its
    value head."""
    per = heads // kv_heads
    d = head_dim
    rows = []
    for g in range(kv_heads):
        rows.append(torch.arange(g * per * d, (g + 1) * per * d))
        rows.append(heads * d + torch.arange(g * d, (g + 1) * d))
        rows.append((heads + kv_heads) * d + torch.arange(g * d, (g + 1) * d))
    return torch.cat(rows)


class CanonicalOrder:
    """The parameters whose rows the tensor-parallel model keeps in another order (the
    grouped q/k/v projections), by name: :meth:`to_model` and :meth:`to_canonical` convert a
    whole tensor (weights, or an optimizer's moments of them) between the orders."""

    def __init__(self) -> None:
        self.rows: dict[str, Tensor] = {}

    def add(self, name: str, rows: Tensor) -> None:
        self.rows[name] = rows

    def __bool__(self) -> bool:
        return bool(self.rows)

    def _convert(self, name: str, value: Any, inverse: bool) -> Any:
        rows = self.rows.get(name)
        if rows is None or not isinstance(value, Tensor) or value.dim() == 0:
            return value
        if value.shape[0] != rows.numel():
            return value
        if inverse:
            out = torch.empty_like(value)
            out[rows.to(value.device)] = value
            return out
        return value[rows.to(value.device)]

    def to_model(self, name: str, value: Any) -> Any:
        """The model's (grouped) order of a tensor given in the canonical order."""
        return self._convert(name, value, inverse=False)

    def to_canonical(self, name: str, value: Any) -> Any:
        """The canonical order of a tensor given in the model's order."""
        return self._convert(name, value, inverse=True)

    def state_to_canonical(self, state: dict[str, Any]) -> dict[str, Any]:
        """A model state dict (names → tensors) in the canonical order."""
        return {k: self.to_canonical(k, v) for k, v in state.items()}

    def state_to_model(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k: self.to_model(k, v) for k, v in state.items()}

    def optimizer_to(self, saved: dict[str, Any], convert: Callable[[str, Any], Any]) -> dict:
        """An optimizer state keyed by parameter name with every tensor converted."""
        state = {
            name: {k: convert(name, v) for k, v in entry.items()}
            for name, entry in saved.get("state", {}).items()
        }
        return {**saved, "state": state}


# -- applying the plans -----------------------------------------------------------------------


def component_plan(module: nn.Module, what: str, tp: int) -> dict[str, Any]:
    """``module.tensor_parallel_plan(tp)``, or one line refusing a component without it."""
    method = getattr(module, "tensor_parallel_plan", None)
    if method is None:
        raise LlmkitError(
            f"{what} ({type(module).__module__}.{type(module).__qualname__}) declares no "
            "tensor-parallel plan (a tensor_parallel_plan(tp) method), so it cannot train "
            f"with train.parallel.tp = {tp}"
        )
    plan = method(tp)
    if not isinstance(plan, dict):
        raise LlmkitError(f"{what}: tensor_parallel_plan must return a dict, not {type(plan)}")
    return plan


def apply_plan(module: nn.Module, plan: dict[str, Any], mesh: Any) -> None:
    """Apply a component's plan (paths relative to ``module``; ``""`` is ``module``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    for path, style in plan.items():
        target = module.get_submodule(path) if path else module
        parallelize_module(target, mesh, style)


def _qualified(model: nn.Module, target: nn.Module) -> str:
    for name, mod in model.named_modules():
        if mod is target:
            return name
    raise LlmkitError("tensor parallelism: a layer part is not a submodule of the model")


def parallelize_transformer(model: nn.Module, mesh: Any) -> CanonicalOrder:
    """Split ``model`` (a Transformer) over the 1-D tensor-parallel ``mesh`` in place, every
    component by its declared plan; returns the rows reordered for checkpoints."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    tp = mesh.size()
    rank = mesh.get_local_rank()
    spec = model.spec
    order = CanonicalOrder()
    for scheme, what in [(model.position, f"position {spec.position.name!r}")] + [
        (model.layer_position(j), f"position {plan.position.name!r} (layer {j})")
        for j, plan in enumerate(spec.layers)
    ]:
        if component_plan(scheme, what, tp):
            raise LlmkitError(f"{what}: positional schemes are not split (plan must be {{}})")
    gather = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    gather_attention = PrepareModuleInput(
        input_layouts=(Shard(1), None),
        desired_input_layouts=(Replicate(), None),
        use_local_output=True,
    )
    for j, (block, plan) in enumerate(zip(model.layers, spec.layers, strict=True)):
        attention, ffn = model.attention_modules[j], model.ffn_modules[j]
        apply_plan(block, component_plan(block, f"block {plan.block.name!r} (layer {j})", tp), mesh)
        for k, norm in enumerate(model.norm_modules[j]):
            what = f"norm {plan.norm.name!r} (layer {j}, norm {k + 1})"
            apply_plan(norm, component_plan(norm, what, tp), mesh)
        kernel_plan = component_plan(attention.kernel, f"attention {plan.attention.name!r}", tp)
        if kernel_plan:
            raise LlmkitError(
                f"attention {plan.attention.name!r} (layer {j}): an attention kernel has no "
                "weights to split (its plan must be {}; it computes on the rank's heads)"
            )
        if attention.qk_transform is not None:
            qk = plan.get("qk_transform")
            what = f"qk_transform {qk.name if qk is not None else '?'!r} (layer {j})"
            apply_plan(
                attention.qk_transform, component_plan(attention.qk_transform, what, tp), mesh
            )
        name = _qualified(model, attention)
        rows = attention.split_heads(tp, rank)
        parallelize_module(attention, mesh, gather_attention)
        if rows is None:  # more ranks than kv heads: the fused projection whole on each
            distribute_module(attention.qkv, mesh)
            parallelize_module(attention, mesh, {"out_proj": row()})
        else:
            order.add(f"{name}.qkv.weight", rows)
            if attention.qkv.bias is not None:
                order.add(f"{name}.qkv.bias", rows)
            parallelize_module(attention, mesh, {"qkv": column(), "out_proj": row()})
        ffn_plan = component_plan(ffn, f"ffn {plan.ffn.name!r} (layer {j})", tp)
        if "" not in ffn_plan:
            parallelize_module(ffn, mesh, gather)
        apply_plan(ffn, ffn_plan, mesh)
    if not isinstance(model.norm_f, nn.Identity):
        apply_plan(model.norm_f, component_plan(model.norm_f, f"norm {spec.norm.name!r}", tp), mesh)
    tied = model.lm_head.weight is model.tok_emb.weight
    head = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1))
    parallelize_module(model.lm_head, mesh, head)
    embed = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if tied:  # one parameter split by vocabulary rows in both
        model.tok_emb.weight = model.lm_head.weight
    parallelize_module(model.tok_emb, mesh, embed)
    if tied:
        model.lm_head.weight = model.tok_emb.weight
    model.tensor_parallel = TensorParallelState(mesh)
    return order


class TensorParallelState:
    """What the model's forward needs under tensor parallelism: the mesh, splitting the
    residual stream along the sequence, and the vocabulary-parallel cross-entropy."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.size = mesh.size()

    def split_sequence(self, x: Tensor) -> Tensor:
        """The rank's part of ``x`` (B, T, C), whole on every rank, along T (the gradient is
        gathered back)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if x.shape[1] % self.size:
            raise LlmkitError(
                f"tensor parallelism splits the sequence over {self.size} ranks; "
                f"{x.shape[1]} tokens is not a multiple"
            )
        whole = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        return whole.redistribute(self.mesh, [Shard(1)]).to_local()

    def cross_entropy(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The mean cross-entropy (targets of -100 ignored) of ``logits`` (..., V/tp), this
        rank's slice of the vocabulary, as a scalar on every rank: the logits are never
        gathered (Megatron-LM's vocabulary-parallel cross-entropy)."""
        keep = targets.reshape(-1) != -100
        return self.cross_entropy_sum(logits, targets) / keep.sum()

    def cross_entropy_sum(self, logits: Tensor, targets: Tensor) -> Tensor:
        """:meth:`cross_entropy` summed over the targets instead of averaged."""
        group = self.mesh.get_group()
        flat = logits.float().reshape(-1, logits.shape[-1])
        start = self.mesh.get_local_rank() * flat.shape[-1]
        return _VocabParallelCE.apply(flat, targets.reshape(-1), start, group).sum()

    def whole(self, logits: Tensor) -> Tensor:
        """This rank's vocabulary slice of ``logits`` gathered into the whole logits
        (evaluation, generation, another loss), differentiably."""
        from torch.distributed.tensor import DTensor, Shard

        split = DTensor.from_local(logits, self.mesh, [Shard(logits.dim() - 1)], run_check=False)
        return split.full_tensor()


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary over ``group``: the max, the
    sum of exponentials and the target's logit are all-reduced (three small collectives);
    the backward is local: softmax minus the one-hot of targets in this rank's slice."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, start: int, group: Any) -> Tensor:
        import torch.distributed as dist

        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        v = logits.shape[-1]
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < v)
        idx = local_t.clamp(0, v - 1)
        target_logit = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine
        dist.all_reduce(target_logit, group=group)
        ignored = targets == -100
        losses = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, mine & ~ignored, ignored)
        return losses

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        softmax, idx, mine, ignored = ctx.saved_tensors
        g = softmax
        g.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g = g * grad.masked_fill(ignored, 0.0).unsqueeze(-1)
        return g, None, None, None
