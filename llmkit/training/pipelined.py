"""Training through pipeline stages (``train.parallel.pp > 1``): the pieces the strategy and
the training step use beyond :mod:`llmkit.parallel.pipeline`.

- :class:`RankStages` is this rank's stage modules as one module under the model's names:
  what the optimizer, the gradient norm, FSDP2 and checkpoints see (the model object itself
  is a shell on the meta device outside the stages this rank holds).
- :class:`PipelinedTraining` runs one accumulation step's batch through the schedule with
  the training step's weighting (each rank's mean over its targets times its share of the
  step's targets), evaluates validation batches, and gathers every stage's weights and
  optimizer state to rank 0 for the plain checkpoint files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.contracts import SideOutputs
from llmkit.errors import LlmkitError

__all__ = ["PipelinedTraining", "RankStages", "merge_optimizer_states"]


class RankStages(nn.Module):
    """This rank's stage modules (:class:`llmkit.parallel.pipeline.PipelineStageModule`) as
    one module whose parameter names are the model's (``tok_emb.weight``,
    ``layers.3.attn.qkv.weight``, ``lm_head.weight``). It is never called: the pipeline
    schedule runs the stages."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        self.layer_positions = nn.ModuleDict()
        for module in modules:
            for name, child in module.named_children():
                if name in ("layers", "layer_positions"):
                    getattr(self, name).update(child)
                elif name not in self._modules:
                    self.add_module(name, child)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise LlmkitError("a pipeline rank's stages run through the pipeline schedule")


def merge_optimizer_states(
    states: Sequence[dict[str, Any]], model_order: dict[str, int]
) -> dict[str, Any]:
    """One optimizer state keyed by parameter name from the states of several stages' ranks
    (each keyed by name): the moments joined, each group's parameter list joined by group
    name and put in the model's parameter order (what one process's optimizer numbers)."""
    state: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for part in states:
        state.update(part["state"])
        for i, group in enumerate(part["param_groups"]):
            key = group.get("group_name", str(i))
            if key in groups:
                groups[key]["params"] = groups[key]["params"] + list(group["params"])
            else:
                groups[key] = {**group, "params": list(group["params"])}
    for group in groups.values():  # groups in order of first appearance (decay, no_decay)
        group["params"].sort(key=lambda n: model_order.get(n, len(model_order)))
    return {"state": state, "param_groups": list(groups.values())}


class PipelinedTraining:
    """The pipeline of one rank: its stages, the schedule, and the module of its parameters.

    ``stages`` are this rank's torch ``PipelineStage`` s (:func:`build_stages`); ``model`` the
    whole model's shell (for the parameter order of checkpoints); ``is_writer`` whether
    this rank speaks for its stage when the stages' weights are gathered (data-parallel,
    tensor- and context-parallel index 0)."""

    def __init__(
        self,
        stages: Sequence[Any],
        model: nn.Module,
        *,
        schedule: str,
        microbatches: int,
        is_writer: bool,
    ) -> None:
        from llmkit.parallel.pipeline import Pipeline

        self.stages = list(stages)
        self.modules = [stage.submod for stage in self.stages]
        for module in self.modules:
            if any(isinstance(m, SideOutputs) for m in module.modules()):
                raise LlmkitError(
                    "pipeline parallelism does not train auxiliary losses (a component "
                    "reports side outputs, e.g. a mixture-of-experts load-balancing loss); "
                    "use pp = 1"
                )
        self.held = RankStages(self.modules)
        self.tensor_parallel = getattr(model, "tensor_parallel", None)
        self.model_order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        self.pipeline = Pipeline(self.stages, schedule, microbatches, loss_fn=self._loss)
        self.microbatches = microbatches
        self.is_writer = is_writer
        self._scale: Tensor | float = 1.0

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """A micro-batch's summed cross-entropy times the current scale (times the number
        of micro-batches, which :class:`Pipeline` divides by)."""
        if self.tensor_parallel is not None:  # logits split by vocabulary
            total = self.tensor_parallel.cross_entropy_sum(logits, targets)
        else:
            total = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)),
                targets.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
        return total * self._scale * self.microbatches

    def train(self, x: Tensor, y: Tensor, weight: Tensor) -> Tensor:
        """Forward and backward of one accumulation micro-batch ``x``, ``y`` (B, T) through
        the schedule, its loss the mean over its trained targets times ``weight`` (the
        training step's share); returns that loss on the last stage's ranks, 0 elsewhere."""
        count = (y != -100).sum().clamp(min=1)
        self._scale = weight / count
        out = self.pipeline.step(x, y)
        self._scale = 1.0
        return out.float() if out is not None else torch.zeros((), device=x.device)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[Tensor, Tensor]]) -> tuple[float, int]:
        """The summed cross-entropy and the number of trained targets of ``batches`` on the
        last stage's ranks (0 and 0 elsewhere); every rank of the pipeline runs them."""
        total, count = 0.0, 0
        self.pipeline.train(False)
        try:
            for x, y in batches:
                out = self.pipeline.evaluate(x, y)
                if out is not None:
                    total += float(out)
                    count += int((y != -100).sum())
        finally:
            self.pipeline.train(True)
        return total, count

    # -- checkpoints ---------------------------------------------------------------------------
    def _gather(self, part: Any) -> list[Any] | None:
        """Every stage writer's ``part`` on global rank 0 (None elsewhere): an object gather
        over the world, the non-writers sending None."""
        world = dist.get_world_size()
        out: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
        dist.gather_object(part if self.is_writer else None, out, dst=0)
        return None if out is None else [p for p in out if p is not None]

    def full_state(self) -> dict[str, Tensor] | None:
        """The whole model's weights on CPU on rank 0 (None elsewhere), keyed by the model's
        names: each stage's (gathered over its data-parallel ranks) sent to rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        local = get_model_state_dict(self.held, options=StateDictOptions(full_state_dict=True))
        local = {k: v.detach().cpu() for k, v in local.items()}
        parts = self._gather(local)
        if parts is None:
            return None
        merged: dict[str, Tensor] = {}
        for part in parts:
            merged.update(part)
        return merged

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The optimizer's whole state keyed by parameter name on rank 0 (None elsewhere)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        local = get_optimizer_state_dict(self.held, optimizer, options=opts)
        local = _to_cpu(local)
        parts = self._gather(local)
        if parts is None:
            return None
        return merge_optimizer_states(parts, self.model_order)

    def held_part(
        self, weights: dict[str, Tensor], optimizer_state: dict[str, Any]
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The entries of whole weights and a whole optimizer state (keyed by name) that
        this rank's stages hold."""
        names = set(self.held.state_dict().keys())
        params = {n for n, _ in self.held.named_parameters()}
        missing = sorted(names - set(weights))
        if missing:
            raise LlmkitError(f"the checkpoint has no {missing[0]!r}")
        kept = {k: v for k, v in weights.items() if k in names}
        state = {k: v for k, v in optimizer_state["state"].items() if k in params}
        groups = []
        for group in optimizer_state["param_groups"]:
            mine = [n for n in group["params"] if n in params]
            if mine:
                groups.append({**group, "params": mine})
        return kept, {"state": state, "param_groups": groups}


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
