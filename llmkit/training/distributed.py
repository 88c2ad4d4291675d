"""Training on several processes with PyTorch's own distributed engine.

``llmkit train`` launched by ``torchrun`` finds ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in
its environment, joins the process group (nccl on CUDA, gloo on CPU) and wraps the model as
``train.parallel`` says:

- ``ddp``: :class:`torch.nn.parallel.DistributedDataParallel`, every rank a full replica;
- ``fsdp``: FSDP2 ``fully_shard`` on every transformer block and then the root, with a
  mixed-precision policy from ``train.precision`` and optional CPU offload.

The trainer talks to one :class:`DistContext` and never to ``torch.distributed`` itself, so
a single process is the same code with ``world_size == 1``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmkit.errors import LlmkitError

log = logging.getLogger("llmkit.training.distributed")

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


def wrap(model: nn.Module, ctx: DistContext, train: Any, precision: str) -> nn.Module:
    """The module the training step calls: ``model`` itself, a DDP wrapper, or ``model``
    sharded in place by FSDP2 (per block, then the root)."""
    if not ctx.distributed:
        return model
    if ctx.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    kw: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32),
        "reshard_after_forward": train.fsdp_reshard_after_forward,
    }
    if train.fsdp_cpu_offload and ctx.device.type != "cpu":
        kw["offload_policy"] = CPUOffloadPolicy()
    elif train.fsdp_cpu_offload and ctx.is_main:
        log.info("train.fsdp_cpu_offload: training on the CPU already; nothing to offload")
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


@contextlib.contextmanager
def grad_sync(module: nn.Module, ctx: DistContext, sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on non-final micro-steps of an accumulation."""
    if not ctx.distributed:
        yield
        return
    if ctx.parallel == "ddp":
        with contextlib.nullcontext() if sync else module.no_sync():
            yield
        return
    module.set_requires_gradient_sync(sync)  # FSDP2: also reduce-scatters only when True
    yield


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
