"""Expert parallelism for mixture-of-experts layers, inside tensor parallelism.

Under ``train.parallel.tp = N`` a mixture-of-experts layer keeps ``num_experts / N`` of its
experts on each rank (the stacked expert tensors split along the expert dimension) and its
router and shared expert whole. The dispatch is the all-gather one of Megatron-LM's MoE
layer: the layer gathers the sequence (every rank then holds every token of the
micro-batch), routes every token (identically on every rank), runs the tokens sent to its
own experts, and the partial outputs are summed and scattered back along the sequence
(reduce-scatter), which is where the sequence-parallel residual stream wants them.

Gradients follow from what each rank computes: the expert tensors' are the rank's own; the
router's and the shared expert's are partial on every rank (each sees only its experts'
share of the output), so :func:`summed_gradient` all-reduces them; the input's are
reduce-scattered by the gather's backward. A quantity every rank computes whole (the
router's auxiliary losses) contributes ``1/N`` of its gradient per rank
(:func:`scaled_gradient`), so that the sums come out once.

:func:`expert_parallel` is the style a mixture-of-experts component returns from its
``tensor_parallel_plan`` for itself (path ``""``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["expert_parallel", "local_part", "scaled_gradient", "summed_gradient"]


class _SumGradient(torch.autograd.Function):
    """Identity forward; the backward all-reduces (sums) the gradient over ``group``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def summed_gradient(x: Tensor, group: Any) -> Tensor:
    """``x`` itself, whose gradient is summed over the ranks of ``group`` (each rank having
    computed a part of it)."""
    return _SumGradient.apply(x, group)


def scaled_gradient(x: Tensor, factor: float) -> Tensor:
    """``x`` itself, whose gradient is multiplied by ``factor``."""
    return _ScaleGradient.apply(x, factor)


def local_part(p: Tensor) -> tuple[Tensor, Any]:
    """A parameter as this rank uses it, and the tensor-parallel mesh (None without one):
    the rank's experts of a split expert tensor, or a whole replicated weight whose gradient
    is summed over the ranks."""
    mesh = getattr(p, "device_mesh", None)  # a DTensor's (no import of DTensor otherwise)
    if mesh is None:
        return p, None
    local = p.to_local()
    if all(placement.is_replicate() for placement in p.placements):
        local = summed_gradient(local, mesh.get_group())
    return local, mesh


def _style(split: tuple[str, ...]) -> Any:
    from torch.distributed.tensor import (
        DTensor,
        Partial,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
    )
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class ExpertParallel(ParallelStyle):
        """Experts split along dim 0 (the parameters named in ``split``), every other
        parameter whole; the input gathered along the sequence, the output reduce-scattered
        back (see the module doc)."""

        def _apply(self, module: nn.Module, mesh: Any) -> nn.Module:
            def partition(name: str, mod: nn.Module, dmesh: Any) -> None:
                for key, p in list(mod.named_parameters(recurse=False)):
                    full = f"{name}.{key}" if name else key
                    placement = Shard(0) if full in split else Replicate()
                    dist = nn.Parameter(
                        distribute_tensor(p.data, dmesh, [placement]), p.requires_grad
                    )
                    mod.register_parameter(key, dist)

            def inputs(_mod: nn.Module, args: tuple[Any, ...], dmesh: Any) -> tuple[Any, ...]:
                x, *rest = args
                seq = DTensor.from_local(x, dmesh, [Shard(1)], run_check=False)
                whole = seq.redistribute(dmesh, [Replicate()]).to_local(grad_placements=[Partial()])
                return (whole, *rest)

            def outputs(_mod: nn.Module, out: Tensor, dmesh: Any) -> Tensor:
                partial = DTensor.from_local(out, dmesh, [Partial()], run_check=False)
                return partial.redistribute(dmesh, [Shard(1)]).to_local()

            return distribute_module(module, mesh, partition, inputs, outputs)

    return ExpertParallel()


def expert_parallel(split: Iterable[str]) -> Any:
    """The tensor-parallel style of a mixture-of-experts module whose parameters named in
    ``split`` (paths relative to it) stack the experts along dim 0."""
    return _style(tuple(split))
