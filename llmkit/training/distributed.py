"""Training on several processes with PyTorch's own distributed engine.

``llmkit train`` launched by ``torchrun`` finds ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in
its environment and joins the process group (nccl on CUDA, gloo on CPU). This module is the
plumbing: :class:`DistContext` (rank, world size, collectives), sharded state for
``torch.distributed.checkpoint``, and a clean exit. What differs between a single process,
DDP and FSDP is decided in one place, :class:`llmkit.training.strategy.ParallelStrategy`;
the trainer never calls ``torch.distributed`` itself, and a single process is the same code
with ``world_size == 1``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmkit.errors import LlmkitError

#: Set once a process group was created here; ``exit_process`` then tears it down.
_INITIALIZED = False


def launched_world_size() -> int:
    """``WORLD_SIZE`` from the launcher's environment (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as exc:
        raise LlmkitError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from exc


@dataclass
class DistContext:
    """This process's place in the job and the collectives the trainer needs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    parallel: str = "none"  # "none", "ddp" or "fsdp"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def mean(self, values: Sequence[float | torch.Tensor]) -> list[float]:
        """The mean of each value over ranks, in one all-reduce (one sync)."""
        if not values:
            return []
        t = torch.stack(
            [torch.as_tensor(v, dtype=torch.float32).detach().reshape(()) for v in values]
        ).to(self.device)
        if self.distributed:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
            t = t / self.world_size
        return t.cpu().tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        """The sum of each value over ranks (float64 on the wire, for token counts)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        if self.distributed:
            t = t.to(self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t.cpu().tolist()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]


def setup(parallel: str, device: str, timeout_s: float) -> DistContext:
    """The :class:`DistContext` for this process, joining the process group if launched.

    ``parallel`` is ``train.parallel``: ``auto`` means DDP when launched on several
    processes; ``ddp``/``fsdp`` on one process train plainly (nothing to split).
    """
    from llmkit import hardware

    world = launched_world_size()
    if world <= 1:
        return DistContext(device=hardware.choose_device(device))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    chosen = "ddp" if parallel in ("auto", "none") else parallel
    if parallel == "none":
        raise LlmkitError(
            f"train.parallel is 'none' but the job was launched on {world} processes; "
            "set train.parallel to 'ddp' or 'fsdp' (or 'auto')"
        )
    dev = hardware.choose_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    elif dev.type == "cpu":
        backend = "gloo"
    else:
        raise LlmkitError(f"distributed training runs on cuda or cpu, not {dev.type}")
    global _INITIALIZED
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        _INITIALIZED = True
    return DistContext(rank, world, local_rank, chosen, dev)


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to a plain tensor (other tensors unchanged)."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state as DTensor shards, for torch.distributed.checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Every rank writes its shards of model and optimizer into the folder ``path``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state(model, optimizer), checkpoint_id=path)


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Load shards saved by :func:`save_sharded` on any number of ranks (resharding)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """An FSDP-sharded model's whole weights on CPU, on rank 0 (empty elsewhere); every rank
    calls it (the shards are gathered)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def exit_process(code: int) -> None:
    """End a process that joined a process group: tear the group down, then leave with
    ``os._exit``. Interpreter shutdown after gloo and torch.distributed.checkpoint
    collectives aborted ("terminate called without an active exception") in about one run
    in eight here; skipping the C++ destructors avoids it. Without a group: returns."""
    if not _INITIALIZED:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and torch.distributed.is_initialized():
        with contextlib.suppress(Exception):
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
