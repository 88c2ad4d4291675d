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
import pickle
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
    parallel: str = "none"  # "none", "ddp", "fsdp" or "mesh"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    layout: Any = None  # llmkit.parallel.layout.Layout (None: one process)

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
        return self.mean_tensor(values).tolist()

    def mean_tensor(self, values: Sequence[float | torch.Tensor]) -> torch.Tensor:
        """The mean of each value over ranks, in one all-reduce, as a float32 vector on this
        process's device that the host has not read: tensors already there are gathered by
        a kernel, floats written by one (``torch.tensor(v, device=cuda)`` would wait for the
        GPU), and an NCCL all-reduce only orders the GPU's stream."""
        parts = [
            v.detach().to(self.device, torch.float32, non_blocking=True).reshape(1)
            if isinstance(v, torch.Tensor)
            else torch.full((1,), float(v), dtype=torch.float32, device=self.device)
            for v in values
        ]
        t = torch.cat(parts) if parts else torch.zeros(0, device=self.device)
        if self.distributed:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
            t = t / self.world_size
        return t

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over ranks (in place, one all-reduce; itself on one process), on its
        device: the host reads nothing."""
        if self.distributed:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t

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


def setup(parallel: Any, device: str, timeout_s: float) -> DistContext:
    """The :class:`DistContext` for this process, joining the process group if launched.

    ``parallel`` is ``train.parallel``: ``auto`` means DDP when launched on several
    processes; ``ddp``/``fsdp`` on one process train plainly (nothing to split); a table is
    a mesh layout (:func:`llmkit.parallel.layout.resolve_layout`), checked against the world
    size before the process group is joined.
    """
    from llmkit import hardware
    from llmkit.parallel.layout import resolve_layout

    world = launched_world_size()
    layout = resolve_layout(parallel, world)
    if world <= 1:
        return DistContext(device=hardware.choose_device(device), layout=layout)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    chosen = layout.mode
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
    return DistContext(rank, world, local_rank, chosen, dev, layout)


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


#: The opt-in to read FSDP shards (``dcp/``), whose metadata file is a pickle.
TRUST_ENV = "LLMKIT_TRUST_CHECKPOINTS"


def trusts_checkpoints() -> bool:
    """Whether the user opted in (``LLMKIT_TRUST_CHECKPOINTS=1``) to reading FSDP shards."""
    return os.environ.get(TRUST_ENV, "") == "1"


#: What ``dcp/.metadata`` may name: torch.distributed.checkpoint's metadata records, tensor
#: sizes, dtypes and layouts, and paths. Anything else is refused before it is looked up.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles ``dcp/.metadata`` allowing only :data:`_METADATA_CLASSES` and torch dtypes:
    a planted ``__reduce__`` calling anything else fails with :class:`pickle.UnpicklingError`."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _METADATA_CLASSES.get(module, ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


def _restricted_reader(path: str) -> Any:
    """A ``FileSystemReader`` whose metadata goes through :class:`MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with open(os.path.join(str(self.path), name), "rb") as fh:
                metadata = MetadataUnpickler(fh).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


def _tensor_only_planner() -> Any:
    """A ``DefaultLoadPlanner`` whose non-tensor items (optimizer hyperparameters) load with
    ``torch.load(weights_only=True)`` instead of a plain unpickling."""
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return Planner()


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Load shards saved by :func:`save_sharded` on any number of ranks (resharding). Only
    with the opt-in (:func:`trusts_checkpoints`): the metadata is unpickled by
    :class:`MetadataUnpickler`, every other item with ``weights_only=True``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not trusts_checkpoints():
        raise LlmkitError(
            f"{path}: FSDP shards are read by unpickling their metadata; set "
            f"{TRUST_ENV}=1 to read them if you trust this run directory"
        )
    metadata = os.path.join(path, ".metadata")
    try:
        with open(metadata, "rb") as fh:  # checked first, for a one-line refusal
            MetadataUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, ValueError, AttributeError) as exc:
        raise LlmkitError(f"{metadata}: not read ({exc})") from exc
    state = sharded_state(model, optimizer)
    dcp.load(state, storage_reader=_restricted_reader(path), planner=_tensor_only_planner())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An FSDP-sharded optimizer's whole state on CPU on rank 0, keyed by parameter name
    (empty elsewhere); every rank calls it (the shards are gathered)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=opts)


def optimizer_state_by_index(saved: dict[str, Any]) -> dict[str, Any]:
    """A state of :func:`full_optimizer_state` (parameters named) in the form
    ``Optimizer.load_state_dict`` takes (parameters numbered in group order, as saved)."""
    state, groups, index = {}, [], 0
    for group in saved["param_groups"]:
        ids = []
        for name in group["params"]:
            if name in saved["state"]:
                state[index] = saved["state"][name]
            ids.append(index)
            index += 1
        groups.append({**group, "params": ids})
    return {"state": state, "param_groups": groups}


def optimizer_order(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of ``optimizer``'s parameters in the order its state numbers them (group by
    group; a tied parameter under its first name in ``model``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_by_name(
    saved: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    order: list[str] | None = None,
) -> dict[str, Any]:
    """An ``Optimizer.state_dict()`` (parameters numbered in group order) keyed by parameter
    name instead, the names read from ``optimizer``'s groups (the same optimizer built on
    the same model numbers them alike), or given as ``order`` (an optimizer of part of the
    model: the whole model's order)."""
    if order is None:
        order = optimizer_order(model, optimizer)
    state = {order[i]: v for i, v in saved["state"].items()}
    groups, index = [], 0
    for group in saved["param_groups"]:
        n = len(group["params"])
        groups.append({**group, "params": order[index : index + n]})
        index += n
    return {"state": state, "param_groups": groups}


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
) -> None:
    """Whole weights and an optimizer state keyed by parameter name, on every rank, loaded
    into a model split in any way (each rank keeps its part)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=opts)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=opts)


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
