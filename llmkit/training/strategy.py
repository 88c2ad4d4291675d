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
        from llmkit.parallel.layout import Layout
        from llmkit.parallel.tensor import CanonicalOrder

        self.ctx = ctx if ctx is not None else DistContext()
        self.mode = self.ctx.parallel if self.ctx.distributed else "single"
        self.layout: Layout = self.ctx.layout or Layout(form="none")
        self._export: nn.Module | None = None
        #: Rows the model keeps in another order than its checkpoints (tensor parallelism).
        self.order = CanonicalOrder()
        self.place: Any = None  # llmkit.parallel.mesh.MeshPlace, in mesh mode
        #: llmkit.parallel.context.ContextParallel under train.parallel.cp > 1
        self.context: Any = None
        #: llmkit.training.pipelined.PipelinedTraining under train.parallel.pp > 1
        self.pipelined: Any = None
        #: Under pp: the parameter names in the order one process's optimizer numbers them
        #: (set by the trainer), to read an optimizer state saved by index.
        self.optimizer_order: list[str] | None = None
        self._fsdp = self.mode == "fsdp"
        if self.mode == "mesh":
            from llmkit.parallel.mesh import build_mesh

            self.place = build_mesh(self.layout, self.device.type)

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
        """FSDP or a mesh: parameters and optimizer state are split across ranks."""
        return self.mode in ("fsdp", "mesh")

    @property
    def data_rank(self) -> int:
        """This rank's index among the ranks reading different rows (data parallelism):
        tensor-, context- and pipeline-parallel peers read the same rows."""
        return self.place.data_rank if self.place is not None else self.rank

    @property
    def data_replicas(self) -> int:
        """How many ranks read each row whole (tensor- and pipeline-parallel peers; context
        parallel peers read different tokens of it)."""
        return self.layout.tp * self.layout.pp if self.place is not None else 1

    @property
    def data_world(self) -> int:
        """How many ranks read different rows (the data-parallel degree)."""
        return self.layout.dp if self.place is not None else self.world_size

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
        what = self.mode if self.mode != "mesh" else f"mesh {self.layout.describe()}"
        return (
            f"distributed: {what} on {self.world_size} processes "
            f"({torch.distributed.get_backend()}); global batch "
            f"{batch_size * grad_accum * self.data_world} sequences"
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
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        from llmkit.parallel.mesh import fully_shard_model

        if self.mode == "mesh":
            mesh = self._compose(model)
            if self.pipelined is not None and train.compile:  # the schedule calls the blocks
                for stage in self.pipelined.modules:
                    for block in stage.layers.values():
                        block.compile()
            if mesh is None:  # no data-parallel ranks: nothing for FSDP to shard
                return self.trained(model)
            self._fsdp = True
        else:
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
        if self.pipelined is not None:  # each stage: its blocks, then the stage's root
            for stage in self.pipelined.modules:
                fully_shard_model(stage, stage.layers.values(), **kw)
            return self.pipelined.held
        fully_shard_model(model, model.layers, **kw)
        return model

    def trained(self, model: nn.Module) -> nn.Module:
        """The module whose parameters this rank trains: ``model``, or under pipeline
        parallelism this rank's stages (:class:`llmkit.training.pipelined.RankStages`)."""
        return self.pipelined.held if self.pipelined is not None else model

    def _compose(self, model: nn.Module) -> Any:
        """Apply the mesh's model parallelism to ``model`` in place (tensor parallelism by
        the components' plans) and return the mesh FSDP2 shards over (None: one rank)."""
        place = self.place
        if self.layout.tp > 1:
            from llmkit.parallel.tensor import parallelize_transformer

            self.order = parallelize_transformer(model, place.sub("tp"))
        if self.layout.cp > 1:
            from llmkit.parallel.context import ContextParallel

            self.context = ContextParallel.from_group(place.sub("cp").get_group())
            model.context_parallel = self.context
        if self.layout.pp > 1:  # last: the stages take the model's tp and cp state
            from llmkit.parallel.pipeline import build_stages
            from llmkit.training.pipelined import PipelinedTraining

            stages = build_stages(
                model,
                pp_rank=place.pp_rank,
                pp_size=self.layout.pp,
                stages_per_rank=self.layout.stages_per_rank,
                device=self.device,
                group=place.sub("pp").get_group(),
            )
            self.pipelined = PipelinedTraining(
                stages,
                model,
                schedule=self.layout.schedule,
                microbatches=self.layout.microbatches,
                is_writer=place.data_rank == 0 and place.tp_rank == 0 and place.cp_rank == 0,
            )
        return place.fsdp_mesh()

    def context_rows(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's part of every row of a batch under context parallelism (the two
        balanced chunks of :func:`llmkit.parallel.context.shard_indices`); the batch itself
        otherwise."""
        if self.context is None:
            return x, y
        return self.context.shard(x), self.context.shard(y)

    def clip_grad_norm(self, params: Any, max_norm: float) -> Tensor:
        """The gradients' total norm before clipping (a device scalar), clipping them to
        ``max_norm``; over a mesh, every split of the parameters counted once."""
        import math

        params = list(params)
        if self.mode == "mesh":
            from llmkit.parallel.mesh import clip_grad_norm

            return clip_grad_norm(params, max_norm, world=self.world_size, pp=self.layout.pp)
        if math.isinf(max_norm) and hasattr(torch.nn.utils, "get_total_norm"):  # torch ≥ 2.6
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return self.full_tensor(norm)

    @contextlib.contextmanager
    def grad_sync(self, wrapped: nn.Module, sync: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on non-final micro-steps of an accumulation."""
        if self.mode == "ddp":
            with contextlib.nullcontext() if sync else wrapped.no_sync():
                yield
            return
        if self._fsdp and self.pipelined is None:  # a pipeline's stages sync by themselves
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
        if self.pipelined is not None:
            full = self.pipelined.full_state() or {}  # collective: every stage to rank 0
        else:
            full = distributed.full_model_state(model)  # collective
        if not self.is_main:
            return None
        full = self.order.state_to_canonical(full)
        if self._export is None:
            self._export = build()
        self._export.load_state_dict(full)
        return self._export

    # -- evaluation --------------------------------------------------------------------------
    def eval_shares(self, batches: Sequence[Batch]) -> tuple[list[Batch], list[Batch]]:
        """This rank's rows of each batch (dealt out round-robin), and batches to run without
        counting: FSDP forwards are collective, so a rank whose share of a short last batch
        is empty still runs one (on another batch's rows)."""
        ws, rank = self.data_world, self.data_rank
        mine = [self.context_rows(x[rank::ws], y[rank::ws]) for x, y in batches]
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
        model = self.trained(model)
        if self.sharded:  # collective: gathered (a pipeline: every stage's) to rank 0
            if self.pipelined is not None:
                full = self.pipelined.full_optimizer_state(optimizer) or {}
            else:
                full = distributed.full_optimizer_state(model, optimizer)
            if self.is_main:
                full = self.order.optimizer_to(full, self.order.to_canonical)
                state = {**state, "optimizer": full, "optimizer_keys": "names"}
                state["parallel"] = self._shards_form()
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
    ) -> str | None:
        """Load weights and optimizer state of ``ckpt``. An FSDP job reads an FSDP
        checkpoint's shards (onto any number of ranks), only with the opt-in
        ``LLMKIT_TRUST_CHECKPOINTS=1``, since their metadata is a pickle; every other process
        reads the plain files (``model.safetensors``, ``state.pt``), which unpickle nothing.
        A sharded job cannot read a plain checkpoint's optimizer state: one line saying so."""
        if self.mode == "mesh":
            return self._load_mesh(ckpt, self.trained(model), optimizer, state)
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
            return None
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
        return None

    # -- checkpoints on a mesh ---------------------------------------------------------------
    def _shards_form(self) -> str:
        """What a checkpoint's shards of this job are like: ``fsdp``, ``mesh``, or
        ``mesh-grouped`` (tensor parallelism keeps the fused q/k/v rows in head groups): a
        job reads shards of its own form only, any other checkpoint from its plain files."""
        if self.mode != "mesh":
            return self.mode
        return "mesh-grouped" if self.order else "mesh"

    def reads_shards(self, ckpt: Path, state: dict[str, Any] | None = None) -> bool:
        """Whether this job resumes ``ckpt`` from its DCP shards (resharding onto this
        layout) rather than from the plain files: an FSDP job always; a mesh job when the
        shards were written by a mesh job and the user opted in to reading them."""
        if self.mode == "fsdp":
            return True
        if self.mode != "mesh" or not (ckpt / SHARDS).is_dir():
            return False
        if not distributed.trusts_checkpoints():
            return False
        if state is None:
            from llmkit.runs.checkpoints import load_state

            state = load_state(ckpt)
        return state.get("parallel") == self._shards_form()

    def _load_mesh(
        self,
        ckpt: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
    ) -> str:
        """Load ``ckpt`` onto this mesh: its DCP shards (:meth:`reads_shards`), or else the
        plain files, which any layout wrote in the model's own order: every rank reads the
        whole weights and optimizer state and keeps its part."""
        if self.reads_shards(ckpt, state):
            distributed.load_sharded(model, optimizer, str(ckpt / SHARDS))
            return f"its {SHARDS}/ shards resharded onto {self.layout.describe()}"
        if "optimizer" not in state:
            raise LlmkitError(
                f"{ckpt}: its optimizer state is only in the fsdp shards ({SHARDS}/); "
                "resume it with train.parallel=fsdp"
            )
        from safetensors.torch import load_file

        weights = self.order.state_to_model(load_file(str(ckpt / WEIGHTS)))
        saved = state["optimizer"]
        if state.get("optimizer_keys") != "names":
            saved = distributed.optimizer_state_by_name(
                saved, model, optimizer, order=self.optimizer_order
            )
        saved = self.order.optimizer_to(saved, self.order.to_model)
        if self.pipelined is not None:  # this rank's stages' part
            weights, saved = self.pipelined.held_part(weights, saved)
        try:
            distributed.load_full_state(model, optimizer, weights, saved)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise LlmkitError(
                f"{ckpt}: the saved weights or optimizer state do not fit this model and "
                f"optimizer ({exc}); a resumed run keeps its optimizer and model"
            ) from exc
        return f"its whole weights split onto {self.layout.describe()}"
