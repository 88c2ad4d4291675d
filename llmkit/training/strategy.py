"""One object for how this process trains: alone, as a DDP replica, or as an FSDP shard.

:class:`ParallelStrategy` holds every decision that differs between the three — wrapping
the model, gradient synchronization, what a checkpoint holds and how it loads, the whole
model for export, which process writes files, how evaluation rows are dealt out — so the
trainer asks it instead of testing ``parallel`` and the world size itself. Its ``mode`` is
fixed once: ``ddp``/``fsdp`` asked for on a single process train as ``single`` (there is
nothing to split). Process-group plumbing (joining, collectives) is
:mod:`llmkit.training.distributed`'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llmkit.errors import LlmkitError
from llmkit.runs.checkpoints import SHARDS, WEIGHTS, Checkpoints, load_weights, rng_state
from llmkit.training import distributed
from llmkit.training.distributed import DistContext

log = logging.getLogger("llmkit.training.strategy")

Batch = tuple[Tensor, Tensor]


class ParallelStrategy:
    """Single process, DDP or FSDP: the decisions of one training process.

    ``mode`` is ``"single"``, ``"ddp"`` or ``"fsdp"``. Collectives (``mean``, ``sum``,
    ``broadcast``, ``barrier``) are the :class:`DistContext`'s; on one process they return
    their input.
    """

    def __init__(self, ctx: DistContext | None = None) -> None:
        self.ctx = ctx if ctx is not None else DistContext()
        self.mode = self.ctx.parallel if self.ctx.distributed else "single"
        self._export: nn.Module | None = None

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelStrategy:
        """One process on ``device``, without a process group."""
        return cls(DistContext(device=torch.device(device)))

    @classmethod
    def setup(cls, parallel: str, device: str, timeout_s: float) -> ParallelStrategy:
        """This process's strategy, joining the process group when launched by torchrun."""
        return cls(distributed.setup(parallel, device, timeout_s))

    # -- where this process is ---------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, plots, writes shared files and reports."""
        return self.ctx.is_main

    @property
    def distributed(self) -> bool:
        return self.mode != "single"

    @property
    def sharded(self) -> bool:
        """FSDP: parameters and optimizer state are split across ranks."""
        return self.mode == "fsdp"

    # -- collectives -------------------------------------------------------------------------
    def barrier(self) -> None:
        self.ctx.barrier()

    def mean(self, values: Sequence[float | Tensor]) -> list[float]:
        return self.ctx.mean(values)

    def mean_tensor(self, values: Sequence[float | Tensor]) -> Tensor:
        """:meth:`mean` as a float32 vector on this process's device, not read by the host."""
        return self.ctx.mean_tensor(values)

    def sum(self, values: Sequence[float]) -> list[float]:
        return self.ctx.sum(values)

    def sum_tensor(self, t: Tensor) -> Tensor:
        """``t`` summed over ranks on its device (in place), not read by the host."""
        return self.ctx.sum_tensor(t)

    def broadcast(self, obj: Any) -> Any:
        return self.ctx.broadcast(obj)

    def any(self, flags: Sequence[bool]) -> list[bool]:
        """Each flag, true on every rank when it is true on any (one all-reduce)."""
        if not self.distributed:
            return list(flags)
        return [v > 0 for v in self.mean([float(f) for f in flags])]

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the body first (it writes shared caches); the others then reuse them."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def quiet_unless_main(self, log_fn: Callable[[str], None]) -> Callable[[str], None]:
        """``log_fn`` on rank 0, a no-op elsewhere (rank 0 reports for the job)."""
        return log_fn if self.is_main else (lambda _msg: None)

    # -- the model ---------------------------------------------------------------------------
    def check_precision(self, precision: str) -> None:
        if self.sharded and precision == "fp16":
            raise LlmkitError("train.precision fp16 is not supported with fsdp; use bf16")

    def describe(self, batch_size: int, grad_accum: int) -> str | None:
        """The one-line summary of a multi-process job (None on a single process)."""
        if not self.distributed:
            return None
        return (
            f"distributed: {self.mode} on {self.world_size} processes "
            f"({torch.distributed.get_backend()}); global batch "
            f"{batch_size * grad_accum * self.world_size} sequences"
        )

    def wrap(self, model: nn.Module, train: Any, precision: str) -> nn.Module:
        """The module the training step calls: ``model`` itself, a DDP wrapper, or ``model``
        sharded in place by FSDP2 (per block, then the root) with a mixed-precision policy
        from ``precision`` and ``train.fsdp_*``."""
        if self.mode == "single":
            return model
        if self.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(model, device_ids=ids)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        kw: dict[str, Any] = {
            "mesh": mesh,
            "mp_policy": MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32),
            "reshard_after_forward": train.fsdp_reshard_after_forward,
        }
        if train.fsdp_cpu_offload and self.device.type != "cpu":
            kw["offload_policy"] = CPUOffloadPolicy()
        elif train.fsdp_cpu_offload and self.is_main:
            log.info("train.fsdp_cpu_offload: training on the CPU already; nothing to offload")
        for block in model.layers:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        return model

    @contextlib.contextmanager
    def grad_sync(self, wrapped: nn.Module, sync: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on non-final micro-steps of an accumulation."""
        if self.mode == "ddp":
            with contextlib.nullcontext() if sync else wrapped.no_sync():
                yield
            return
        if self.mode == "fsdp":
            wrapped.set_requires_gradient_sync(sync)  # FSDP2: also reduce-scatters only then
        yield

    @staticmethod
    def full_tensor(x: Tensor) -> Tensor:
        """A DTensor (FSDP's gradient norm) gathered to a plain tensor; others unchanged."""
        return distributed.full_tensor(x)

    def full_model(self, model: nn.Module, build: Callable[[], nn.Module]) -> nn.Module | None:
        """The whole model with current weights on rank 0 (None elsewhere). Under FSDP every
        rank calls it (a gather) and rank 0 gets a plain CPU copy made once by ``build``, so
        every checkpoint and the final weights load on one device."""
        if not self.sharded:
            return model if self.is_main else None
        full = distributed.full_model_state(model)  # collective
        if not self.is_main:
            return None
        if self._export is None:
            self._export = build()
        self._export.load_state_dict(full)
        return self._export

    # -- evaluation --------------------------------------------------------------------------
    def eval_shares(self, batches: Sequence[Batch]) -> tuple[list[Batch], list[Batch]]:
        """This rank's rows of each batch (dealt out round-robin), and batches to run without
        counting: FSDP forwards are collective, so a rank whose share of a short last batch
        is empty still runs one (on another batch's rows)."""
        ws = self.world_size
        mine = [(x[self.rank :: ws], y[self.rank :: ws]) for x, y in batches]
        counted = [b for b in mine if len(b[0])]
        padding = mine[:1] * (len(mine) - len(counted)) if self.sharded else []
        return counted, padding

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(
        self,
        checkpoints: Checkpoints,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        meta: dict[str, Any],
        *,
        best: bool,
        full_model: nn.Module | None,
    ) -> Path:
        """Write checkpoint ``step`` (every rank calls this): rank 0 the whole weights
        (``full_model``) and ``state`` with the optimizer state — under FSDP gathered and
        keyed by parameter name, so that one process can resume from the plain files — each
        rank its RNG state when distributed, and under FSDP every rank its model and
        optimizer shards (resharding on load, for a job that opts in to reading them)."""
        if self.sharded:
            full = distributed.full_optimizer_state(model, optimizer)  # collective
            if self.is_main:
                state = {**state, "optimizer": full, "optimizer_keys": "names"}
        else:
            state = {**state, "optimizer": optimizer.state_dict()}
        return checkpoints.save(
            step,
            full_model,
            state,
            meta,
            best=best,
            dist=self.ctx if self.distributed else None,
            rank_state={"rng": rng_state()} if self.distributed else None,
            write_shards=(
                (lambda d: distributed.save_sharded(model, optimizer, str(d)))
                if self.sharded
                else None
            ),
        )

    def load_checkpoint(
        self,
        ckpt: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
    ) -> None:
        """Load weights and optimizer state of ``ckpt``. An FSDP job reads an FSDP
        checkpoint's shards (onto any number of ranks), only with the opt-in
        ``LLMKIT_TRUST_CHECKPOINTS=1``, since their metadata is a pickle; every other process
        reads the plain files (``model.safetensors``, ``state.pt``), which unpickle nothing.
        A sharded job cannot read a plain checkpoint's optimizer state: one line saying so."""
        if self.sharded:
            if not (ckpt / SHARDS).is_dir():
                raise LlmkitError(
                    f"{ckpt} was not saved by an fsdp run; resume it with train.parallel=ddp"
                )
            if not distributed.trusts_checkpoints():
                raise LlmkitError(
                    f"{ckpt}: an fsdp resume reads the shards in {SHARDS}/, whose metadata is "
                    f"a pickle; set {distributed.TRUST_ENV}=1 if you trust this run directory "
                    "(or resume with train.parallel=ddp, which reads only the plain files)"
                )
            distributed.load_sharded(model, optimizer, str(ckpt / SHARDS))
            return
        if "optimizer" not in state:
            raise LlmkitError(
                f"{ckpt}: its optimizer state is only in the fsdp shards ({SHARDS}/), which "
                f"llmkit reads only in an fsdp job under torchrun with {distributed.TRUST_ENV}=1"
            )
        load_weights(model, ckpt / WEIGHTS)
        saved = state["optimizer"]
        try:
            if state.get("optimizer_keys") == "names":
                saved = distributed.optimizer_state_by_index(saved)
            optimizer.load_state_dict(saved)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise LlmkitError(
                f"{ckpt}: the saved optimizer state does not fit this optimizer ({exc}); "
                "a resumed run keeps its optimizer and model"
            ) from exc
