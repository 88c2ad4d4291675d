"""The Trainer. It knows no concrete component: the model, optimizer, schedule and data
source all come from the resolved spec, and every auxiliary loss or metric a component
reports arrives through the model output's generic side channel."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmkit import hardware
from llmkit.errors import LlmkitError
from llmkit.optim import set_lr_factor
from llmkit.runs import (
    METRICS_FILE,
    PLOT_FILE,
    RESOLVED_FILE,
    SPEC_FILE,
    TOKENIZER_FILE,
    save_spec,
)
from llmkit.runs.checkpoints import (
    SHARDS,
    WEIGHTS,
    Checkpoints,
    DamagedCheckpoint,
    load_state,
    load_tensors,
    load_weights,
    rank_file,
    rng_state,
    set_rng_state,
    weight_shapes,
)
from llmkit.spec import ResolvedSpec, load_spec, load_spec_dict
from llmkit.training import distributed


class NonFiniteLoss(LlmkitError):
    """The loss or gradient became NaN/inf."""


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    tokens: int
    seconds: float
    stopped: str
    val_loss: float | None = None
    best_val_loss: float | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    rank: int = 0
    world_size: int = 1


def _detached(value: Any) -> Any:
    """A reported value as a detached scalar (tensor or float), without a device sync."""
    if isinstance(value, torch.Tensor):
        return value.detach().float().mean()
    return float(value)


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def truncate_after(self, step: int) -> None:
        """Drop lines past ``step`` (written after the checkpoint a run resumes from), and any
        line that is not a JSON object; the file is replaced atomically."""
        if not self.path.is_file():
            return
        keep = [line for line in self.read() if line.get("step", 0) <= step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(line) + "\n" for line in keep))
        os.replace(tmp, self.path)

    def read(self) -> list[dict[str, Any]]:
        """Every record; a line that does not parse (a crash can leave the last one half
        written) is skipped."""
        if not self.path.is_file():
            return []
        records = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


def plot_losses(records: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """The loss curve (train, and validation where evaluated) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


#: During training the loss curve is redrawn at a checkpoint only if this many seconds passed
#: since the last drawing (a drawing costs ≈ 0.3 s on a 2-core CPU); it is always drawn at
#: the end of the run.
PLOT_EVERY_S = 30.0


class Trainer:
    """Trains the model a resolved spec describes, writing everything into ``run_dir``."""

    _plotted = -math.inf  # time.monotonic() of the last loss-curve drawing

    def __init__(
        self,
        rs: ResolvedSpec,
        run_dir: Path,
        *,
        resume: bool = False,
        edited: bool = False,
        max_time: float | None = None,
        log: Callable[[str], None] = print,
        progress: bool | None = None,
        dist: distributed.DistContext | None = None,
    ) -> None:
        self.rs = rs
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.edited = edited  # resumed with --set: rs replaces the run's spec once restored
        self.t = rs.spec.train
        self.max_time = max_time if max_time is not None else self.t.max_time
        self.dist = dist
        self.log = log
        self.progress = progress
        self._stop_signal: str | None = None

    # -- set-up ------------------------------------------------------------------------------
    def _setup(self) -> None:
        from llmkit.data import count_blocks, make_sampler, prepare_data
        from llmkit.model import build_model

        t = self.t
        if self.dist is None:
            self.dist = distributed.setup(t.parallel, t.device, t.dist_timeout)
        dist = self.dist
        if not dist.is_main:  # only rank 0 logs, plots and shows progress
            self.log, self.progress = (lambda _msg: None), False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(t.seed)
        self.device = dist.device
        self.precision = hardware.choose_precision(t.precision, self.device)
        if dist.parallel == "fsdp" and self.precision == "fp16":
            raise LlmkitError("train.precision fp16 is not supported with fsdp; use bf16")
        self.amp = lambda: hardware.autocast(self.device, self.precision)

        if not dist.is_main:
            dist.barrier()  # rank 0 trains the tokenizer and tokenizes first; then the cache
        data = prepare_data(self.rs, self.run_dir, log=self.log)
        if dist.is_main:
            dist.barrier()
        self.data, self.tokenizer = data, data.tokenizer
        if self.tokenizer.vocab_size != self.rs.model.vocab_size:
            self.log(
                f"vocab_size {self.rs.model.vocab_size} -> {self.tokenizer.vocab_size} "
                "(the tokenizer's)"
            )
            self.rs = load_spec_dict(self.rs.raw, [f"model.vocab_size={self.tokenizer.vocab_size}"])
            self.rs.source = str(self.run_dir / SPEC_FILE)
        if not self.resume and dist.is_main:
            save_spec(self.rs, self.run_dir)

        # ≤ max_seq_len: the spec's validation checks it.
        self.block_size = self.rs.spec.data.block_size or self.rs.model.max_seq_len
        self.sampler = make_sampler(
            self.rs.spec.data.sampling,
            data.train,
            self.block_size,
            t.seed,
            rank=dist.rank,
            world_size=dist.world_size,
        )

        # Evaluation needs one validation block: fail now, not after the first eval_interval.
        count_blocks(len(data.validation), self.block_size, "validation split")

        torch.manual_seed(t.seed)  # the same initial weights on every rank
        self.model = build_model(self.rs).to(self.device)
        self.model.activation_checkpointing = t.activation_checkpointing
        self.wrapped = distributed.wrap(self.model, dist, t, self.precision)
        self.forward = torch.compile(self.wrapped) if t.compile else self.wrapped
        if dist.distributed:
            self.log(
                f"distributed: {dist.parallel} on {dist.world_size} processes "
                f"({torch.distributed.get_backend()}); global batch "
                f"{t.batch_size * t.grad_accum * dist.world_size} sequences"
            )
        opt = self.rs.optimizer
        self.optimizer = opt.build(self.model, opt.options)
        sched = self.rs.schedule
        try:
            self.lr_factor = sched.build(sched.options, total_steps=t.max_steps)
        except ValueError as exc:
            raise LlmkitError(f"schedule {sched.name!r}: {exc}") from exc
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        self.checkpoints = Checkpoints(self.run_dir)
        self.metrics = MetricsLog(self.run_dir / METRICS_FILE)

        self.step = 0
        self.tokens = 0
        self.elapsed = 0.0
        self.best_val: float | None = None
        self.bad_evals = 0
        self.flops_per_token = self.model.flops_per_token(self.block_size)["train"]
        peak = hardware.peak_flops(self.device, self.precision)
        self.peak = peak * dist.world_size if peak else peak
        if self.resume:
            self._restore()  # last: it sets the RNG state
            if self.edited and dist.is_main:
                save_spec(self.rs, self.run_dir)  # the edited recipe is the run's from now on

    def _restore(self) -> None:
        """Resume from the latest checkpoint, or from the newest older one that is intact when
        a file of the latest cannot be read."""
        candidates = self.checkpoints.newest_first()
        if not candidates:
            raise LlmkitError(f"{self.run_dir}: no checkpoint to resume from")
        for i, ckpt in enumerate(candidates):
            problem: DamagedCheckpoint | None = None
            try:
                files = self._read_checkpoint(ckpt)
            except DamagedCheckpoint as exc:
                problem = exc
            # Every rank must resume from the same checkpoint: one rank's unreadable file
            # moves them all to the next.
            bad = int(self.dist.sum([1.0 if problem else 0.0])[0])
            if not bad:
                self._restore_from(ckpt, *files)
                return
            why = str(problem) if problem else f"{ckpt} cannot be read on {bad} other rank(s)"
            if i + 1 == len(candidates):
                raise problem or DamagedCheckpoint(why)
            self.log(f"warning: {why}; resuming from {candidates[i + 1].name} instead")

    def _read_checkpoint(self, ckpt: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The trainer state and this rank's own state of ``ckpt``, after checking that its
        weights file reads (header only); :class:`DamagedCheckpoint` when a file does not."""
        state = load_state(ckpt)
        if not (ckpt / SHARDS).is_dir():
            weight_shapes(ckpt / WEIGHTS)
        own = ckpt / rank_file(self.dist.rank)
        rank_state = None
        if self.dist.distributed and own.is_file():
            rank_state = load_tensors(own, "rank state")
        return state, rank_state

    def _restore_from(
        self, latest: Path, state: dict[str, Any], rank_state: dict[str, Any] | None
    ) -> None:
        if self.t.max_steps < int(state["step"]):  # refused before anything is loaded
            raise LlmkitError(
                f"{latest.name}: the run is at step {int(state['step'])} and train.max_steps "
                f"is {self.t.max_steps}; raise it (--max-steps N) to train further"
            )
        # Hyperparameters come from the (possibly edited) spec, the moments from the run.
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        if (latest / SHARDS).is_dir():  # saved by FSDP: reshards onto any number of ranks
            distributed.load_sharded(self.model, self.optimizer, str(latest / SHARDS))
        elif self.dist.parallel == "fsdp" and self.dist.distributed:
            raise LlmkitError(
                f"{latest} was not saved by an fsdp run; resume it with train.parallel=ddp"
            )
        else:
            load_weights(self.model, latest / WEIGHTS)
            try:
                self.optimizer.load_state_dict(state["optimizer"])
            except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                raise LlmkitError(
                    f"{latest}: the saved optimizer state does not fit this optimizer ({exc}); "
                    "a resumed run keeps its optimizer and model"
                ) from exc
        for group, hyper in zip(self.optimizer.param_groups, fresh, strict=True):
            group.update(hyper)
        self.sampler.load_state_dict(state["data"])
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.elapsed = float(state["elapsed"])
        self.best_val = state.get("best_val")
        self.bad_evals = int(state.get("bad_evals", 0))
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        if rank_state is not None:
            set_rng_state(rank_state["rng"])
        elif self.dist.is_main:
            set_rng_state(state["rng"])
        else:  # a rank the saving run did not have: a fresh stream of its own
            torch.manual_seed(self.t.seed + 1000 * self.dist.rank + self.step)
        if self.dist.is_main:
            self.metrics.truncate_after(self.step)
        self.log(f"resumed from {latest} at step {self.step}")

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        self._setup()
        t = self.t
        self._install_signals()
        history = self.metrics.read()
        total_params = self.model.num_params()
        self.log(
            f"model: {total_params:,} parameters, {len(self.model.layers)} layers; "
            f"device {self.device}, precision {self.precision}; "
            f"{len(self.data.train):,} train / {len(self.data.validation):,} val tokens"
        )
        ckpt_every = t.checkpoint_interval or t.eval_interval
        stopped = "max_steps"
        last_val: float | None = None
        start_wall = time.perf_counter() - self.elapsed
        interval_t0, interval_tokens = time.perf_counter(), 0
        bar = self._progress_bar()
        try:
            while self.step < t.max_steps:
                self._injected_failure()
                record = self._train_step()
                if record is None:  # skipped a non-finite step
                    continue
                self.step += 1
                step_tokens = t.batch_size * t.grad_accum * self.block_size * self.dist.world_size
                self.tokens += step_tokens
                interval_tokens += step_tokens
                self.elapsed = time.perf_counter() - start_wall
                if self.step % t.log_interval == 0 or self.step == t.max_steps:
                    now = time.perf_counter()
                    tps = interval_tokens / max(now - interval_t0, 1e-9)
                    interval_t0, interval_tokens = now, 0
                    record.update(
                        tokens=self.tokens,
                        tokens_per_s=round(tps, 1),
                        elapsed=round(self.elapsed, 3),
                    )
                    if self.peak:
                        record["mfu"] = round(self.flops_per_token * tps / self.peak, 4)
                    if self.dist.is_main:
                        self.metrics.write(record)
                    history.append(record)
                    self._show(bar, record)
                out_of_time, signalled = self._stop_flags()
                final = self.step == t.max_steps or out_of_time or signalled
                if self.step % t.eval_interval == 0 or final:
                    last_val = self._evaluate(history)
                    if self._early_stop():
                        stopped = "early_stopping"
                        final = True
                if self.step % ckpt_every == 0 or final or self.step % t.eval_interval == 0:
                    self._save(best=last_val is not None and last_val == self.best_val)
                    now = time.monotonic()
                    if self.dist.is_main and not final and now - self._plotted >= PLOT_EVERY_S:
                        plot_losses(history, self.run_dir / PLOT_FILE, self.rs.spec.name or "")
                        self._plotted = now
                if out_of_time:
                    stopped = "max_time"
                if signalled:
                    stopped = self._stop_signal or "SIGTERM"
                if final:
                    break
        finally:
            self._close(bar)
        self._finish(history)
        return TrainResult(
            self.run_dir,
            self.step,
            self.tokens,
            self.elapsed,
            stopped,
            last_val,
            self.best_val,
            history,
            self.dist.rank,
            self.dist.world_size,
        )

    def _injected_failure(self) -> None:
        """``LLMKIT_FAIL_AT=RANK:STEP`` makes that rank raise before that step: a test aid
        for a launcher's failure handling (the job must exit non-zero, not hang)."""
        at = os.environ.get("LLMKIT_FAIL_AT")
        if at and at == f"{self.dist.rank}:{self.step + 1}":
            raise RuntimeError(f"injected failure on rank {self.dist.rank} (LLMKIT_FAIL_AT={at})")

    def _stop_flags(self) -> tuple[bool, bool]:
        """(out of time, stop signal received). In a multi-process run, any rank's flag
        stops every rank at the same step (one all-reduce), so none waits alone."""
        out_of_time = self.max_time is not None and self.elapsed >= self.max_time
        signalled = self._stop_signal is not None
        if self.dist.distributed:
            flags = self.dist.mean([float(out_of_time), float(signalled)])
            out_of_time, signalled = flags[0] > 0, flags[1] > 0
        return out_of_time, signalled

    def _train_step(self) -> dict[str, Any] | None:
        t = self.t
        set_lr_factor(self.optimizer, self.lr_factor(self.step))
        if not self.model.training:  # (a recursive call: ≈ 0.5 ms a step on a small model)
            self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        aux_sums: dict[str, Any] = {}
        metrics: dict[str, Any] = {}
        for micro in range(t.grad_accum):
            x, y = self.sampler.next_batch(t.batch_size)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            last = micro == t.grad_accum - 1  # only the last micro-step all-reduces
            with distributed.grad_sync(self.wrapped, self.dist, last):
                with self.amp():
                    out = self.forward(x, y)
                    loss = out.total_loss / t.grad_accum
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
            loss_sum += out.loss.detach() / t.grad_accum
            for k, v in out.aux_losses.items():
                aux_sums[k] = aux_sums.get(k, 0.0) + _detached(v) / t.grad_accum
            metrics.update({k: _detached(v) for k, v in out.metrics.items()})
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = t.grad_clip if t.grad_clip is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        grad_norm = distributed.full_tensor(grad_norm)
        # Everything reported, averaged over ranks, in one transfer (one sync).
        names = [f"aux/{k}" for k in aux_sums] + [f"metric/{k}" for k in metrics]
        loss_value, *values = self.dist.mean([loss_sum, *aux_sums.values(), *metrics.values()])
        reported = dict(zip(names, values))
        finite = math.isfinite(loss_value) and bool(torch.isfinite(grad_norm))
        if not finite and self.scaler is None:
            self.optimizer.zero_grad(set_to_none=True)
            return self._non_finite(loss_value, float(grad_norm))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._skipped = 0
        record: dict[str, Any] = {
            "step": self.step + 1,
            "loss": round(loss_value, 6),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": round(float(grad_norm), 6),
        }
        record.update({k: round(v, 6) for k, v in reported.items()})
        return record

    _skipped = 0

    def _non_finite(self, loss: float, grad_norm: float) -> None:
        latest = self.checkpoints.latest()
        where = f"last good checkpoint: {latest}" if latest else "no checkpoint was written yet"
        what = f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'}"
        if self.t.on_nonfinite == "skip":
            self._skipped += 1
            self.log(f"step {self.step + 1}: {what} ({loss}), step skipped")
            if self._skipped < 10:
                return None
            raise NonFiniteLoss(f"10 consecutive steps with a {what}; stopped ({where})")
        raise NonFiniteLoss(
            f"{what} at step {self.step + 1} (loss {loss}, grad norm {grad_norm}); stopped "
            f"without saving ({where}); lower the lr or set train.on_nonfinite='skip'"
        )

    def _evaluate(self, history: list[dict[str, Any]]) -> float:
        from llmkit.data import eval_batches
        from llmkit.training.evaluate import EvalResult, evaluate_batches

        t = self.t
        dist = self.dist
        # The single-process evaluation set (batches of batch_size × world_size blocks), each
        # batch's rows dealt out to the ranks; the token-weighted sums are added up below.
        ws = dist.world_size
        batches = eval_batches(
            self.data.validation, self.block_size, t.batch_size * ws, t.eval_batches
        )
        mine = [(x[dist.rank :: ws], y[dist.rank :: ws]) for x, y in batches]
        if dist.parallel == "fsdp" and dist.distributed:
            # FSDP forwards are collective: a rank whose share of a short last batch is empty
            # still runs one (on another batch's rows, not counted).
            empty = sum(1 for x, _ in mine if len(x) == 0)
            evaluate_batches(self.model, mine[:1] * empty, self.device, self.amp())
        res = evaluate_batches(self.model, [b for b in mine if len(b[0])], self.device, self.amp())
        total, count = dist.sum([res.loss * res.tokens, res.tokens])
        res = EvalResult(total / max(count, 1), int(count))
        improved = self.best_val is None or res.loss < self.best_val
        if improved:
            self.best_val, self.bad_evals = res.loss, 0
        else:
            self.bad_evals += 1
        record = {
            "step": self.step,
            "val_loss": round(res.loss, 6),
            "val_ppl": round(res.ppl, 4),
            "best_val_loss": round(self.best_val, 6),
        }
        if dist.is_main:
            self.metrics.write(record)
        history.append(record)
        self.log(
            f"step {self.step}: val loss {res.loss:.4f}, ppl {res.ppl:.2f}"
            f"{' (best)' if improved else ''}"
        )
        return res.loss

    def _early_stop(self) -> bool:
        patience = self.t.early_stopping_patience
        return patience is not None and self.bad_evals >= patience

    def _save(self, best: bool) -> None:
        dist = self.dist
        sharded = dist.parallel == "fsdp" and dist.distributed
        state: dict[str, Any] = {
            "data": self.sampler.state_dict(),
            "rng": rng_state(),
            "step": self.step,
            "tokens": self.tokens,
            "elapsed": self.elapsed,
            "best_val": self.best_val,
            "bad_evals": self.bad_evals,
        }
        if not sharded:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        meta = {"tokens": self.tokens, "best_val_loss": self.best_val}
        self.checkpoints.save(
            self.step,
            self._full_model(),
            state,
            meta,
            best=best,
            dist=dist if dist.distributed else None,
            rank_state={"rng": rng_state()} if dist.distributed else None,
            write_shards=(
                (lambda d: distributed.save_sharded(self.model, self.optimizer, str(d)))
                if sharded
                else None
            ),
        )

    def _full_model(self) -> torch.nn.Module | None:
        """The whole model with current weights on rank 0 (None elsewhere). Under FSDP the
        shards are gathered into a plain CPU copy, so every checkpoint and the final
        ``model.safetensors`` load on one device with ``llmkit generate``."""
        dist = self.dist
        if not (dist.parallel == "fsdp" and dist.distributed):
            return self.model if dist.is_main else None
        from llmkit.model import build_model

        full = distributed.full_model_state(self.model)  # collective
        if not dist.is_main:
            return None
        if getattr(self, "_export", None) is None:
            self._export = build_model(self.rs)
        self._export.load_state_dict(full)
        return self._export

    def _finish(self, history: list[dict[str, Any]]) -> None:
        from llmkit.runs.checkpoints import save_weights

        model = self._full_model()
        if self.dist.is_main:
            save_weights(model, self.run_dir / "model.safetensors")
            plot_losses(history, self.run_dir / PLOT_FILE, self.rs.spec.name or "")

    # -- output ------------------------------------------------------------------------------
    def _progress_bar(self) -> Any:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        console = Console(stderr=True)
        enabled = console.is_terminal if self.progress is None else self.progress
        if not enabled:
            return None
        bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        bar.start()
        bar.add_task("train", total=self.t.max_steps, completed=self.step, info="")
        self.log = bar.console.print if self.log is print else self.log
        return bar

    def _show(self, bar: Any, record: dict[str, Any]) -> None:
        info = f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s"
        if "mfu" in record:
            info += f" mfu {100 * record['mfu']:.1f}%"
        if bar is None:
            self.log(f"step {record['step']}/{self.t.max_steps}: {info}")
        else:
            bar.update(0, completed=record["step"], info=info)

    def _close(self, bar: Any) -> None:
        if bar is not None:
            bar.stop()
        self._restore_signals()

    def _install_signals(self) -> None:
        self._old_handlers = {}

        def handler(signum: int, _frame: Any) -> None:
            self._stop_signal = signal.Signals(signum).name
            self.log(f"{self._stop_signal}: stopping after this step and saving a checkpoint")

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread
                self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signals(self) -> None:
        for sig, old in getattr(self, "_old_handlers", {}).items():
            signal.signal(sig, old)


def train(
    spec_path: str | Path | None = None,
    *,
    run_dir: str | Path | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    max_time: float | None = None,
    log: Callable[[str], None] = print,
    progress: bool | None = None,
) -> TrainResult:
    """Train from a spec file, or resume the run in ``run_dir``."""
    from llmkit.runs import default_run_dir

    if resume:
        if run_dir is None:
            raise LlmkitError("--resume needs the run directory")
        rd = Path(run_dir)
        if not (rd / SPEC_FILE).is_file():
            raise LlmkitError(f"{rd} is not a run directory (no {SPEC_FILE})")
        rs = load_spec(rd / SPEC_FILE, overrides or [])
    else:
        if spec_path is None:
            raise LlmkitError("a spec file is required (or --resume RUN_DIR)")
        rs = load_spec(spec_path, overrides or [])
        rd = Path(run_dir) if run_dir else default_run_dir(rs)
        if (rd / "checkpoints").exists():
            raise LlmkitError(
                f"{rd} already holds a run; resume it with --resume {rd} or choose another --out"
            )
        if rd.exists() and (not rd.is_dir() or not _restartable(rd)):
            raise LlmkitError(
                f"{rd} exists and is not an empty directory; training would overwrite its "
                "files (a run that stopped before its first checkpoint leaves such a directory): "
                "remove it or choose another --out"
            )
    t = rs.spec.train
    dist = distributed.setup(t.parallel, t.device, t.dist_timeout)
    rd = Path(dist.broadcast(str(rd)))  # rank 0's (time-stamped) choice for everyone
    if resume and overrides:
        _check_same_optimizer(load_spec(rd / SPEC_FILE), rs)
    trainer = Trainer(
        rs,
        rd,
        resume=resume,
        edited=bool(resume and overrides),
        max_time=max_time,
        log=log,
        progress=progress,
        dist=dist,
    )
    return trainer.fit()


#: What a run writes before its first step: a directory holding only these (and llmkit's
#: resolved.json among them) is a run that stopped before training, and may start again.
_SETUP_FILES = {SPEC_FILE, RESOLVED_FILE, TOKENIZER_FILE, "data"}


def _restartable(rd: Path) -> bool:
    """True for an empty directory, or one a run left before its first step."""
    names = {p.name for p in rd.iterdir()}
    return not names or (RESOLVED_FILE in names and names <= _SETUP_FILES)


def _check_same_optimizer(saved: ResolvedSpec, edited: ResolvedSpec) -> None:
    """``--set`` on resume may change hyperparameters, not the optimizer whose state it loads."""
    before, after = saved.optimizer.record.name, edited.optimizer.record.name
    if before != after:
        raise LlmkitError(
            f"the run was trained with optimizer {before!r}; resuming it with {after!r} cannot "
            "load its state (start a new run, or keep the optimizer)"
        )
