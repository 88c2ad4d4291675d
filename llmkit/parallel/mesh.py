"""The job's device mesh (``pp × dp_replicate × dp_shard × cp × tp``) and what a composed
layout needs besides the model's own plans: where this rank sits, which ranks read the same
rows, FSDP2 over the data-parallel (and context-parallel) ranks, and the gradient norm over
parameters split in several ways.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from llmkit.parallel.layout import MESH_DIMS, Layout

__all__ = ["MeshPlace", "build_mesh", "clip_grad_norm", "fully_shard_model"]


class MeshPlace:
    """This rank's coordinates on the mesh, and the sub-meshes a layout uses."""

    def __init__(self, layout: Layout, mesh: Any) -> None:
        self.layout = layout
        self.mesh = mesh
        coords = mesh.get_coordinate()
        self.coords = dict(zip(MESH_DIMS, coords, strict=True))

    @property
    def data_rank(self) -> int:
        """The rank's index among the data-parallel ranks (those reading different rows)."""
        return self.coords["dp_replicate"] * self.layout.dp_shard + self.coords["dp_shard"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def data_leader(self) -> bool:
        """Whether this rank speaks for its data-parallel index (tp, cp and pp at 0)."""
        return self.coords["tp"] == self.coords["cp"] == self.coords["pp"] == 0

    def sub(self, *names: str) -> Any:
        return self.mesh[names if len(names) > 1 else names[0]]

    def fsdp_mesh(self) -> Any | None:
        """The mesh FSDP2 shards over: ``dp_shard × cp`` (context-parallel ranks hold the same
        weights, as torchtitan folds them), replicated over ``dp_replicate`` (HSDP); None
        when it is one rank."""
        layout = self.layout
        if layout.dp * layout.cp == 1:
            return None
        if layout.cp == 1:
            dims: tuple[str, ...] = ("dp_shard",)
        else:  # the flattened mesh itself (slicing it from the root mesh is deprecated)
            flat = self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            if layout.dp_replicate == 1:
                return flat
            dims = ("dp_shard_cp",)
        if layout.dp_replicate > 1:
            return self.mesh[("dp_replicate", *dims)]
        return self.mesh[dims[0]]


def build_mesh(layout: Layout, device_type: str) -> MeshPlace:
    """The job's mesh, every dimension named (those of degree 1 included)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
    return MeshPlace(layout, mesh)


def fully_shard_model(model: nn.Module, blocks: Iterable[nn.Module], **kw: Any) -> None:
    """FSDP2 (``fully_shard`` with ``kw``: the mesh, the policies): each block, then the
    root (what is left: embeddings, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def _replicas(p: Tensor, stage_ranks: int) -> int:
    """How many ranks of the pipeline stage hold the same values as this rank's ``p``."""
    shards = 1
    if hasattr(p, "placements"):
        for i, placement in enumerate(p.placements):
            # Shard, or FSDP's _StridedShard over a tensor-parallel split (not is_shard())
            if not placement.is_replicate() and not placement.is_partial():
                shards *= p.device_mesh.size(i)
    return max(stage_ranks // shards, 1)


def clip_grad_norm(
    params: Iterable[nn.Parameter], max_norm: float, *, world: int, pp: int, group: Any = None
) -> Tensor:
    """The total gradient norm over every rank's parameters — split by tensor parallelism,
    sharded by FSDP, held by one pipeline stage, or whole on several ranks — clipping the
    gradients to ``max_norm``. Each rank adds the squares of its local gradients divided by
    how many ranks of its stage hold the same values, and one all-reduce over the world sums
    them (stages hold disjoint layers)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    stage_ranks = world // pp
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    locals_: list[Tensor] = []
    for g in grads:
        local = g.to_local() if hasattr(g, "placements") else g
        locals_.append(local)
        total += local.detach().float().square().sum() / _replicas(g, stage_ranks)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    if not math.isinf(max_norm) and locals_:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for local in locals_:
            local.mul_(coef.to(local.dtype))
    return norm
