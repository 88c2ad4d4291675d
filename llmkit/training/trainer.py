"""The Trainer. It knows no concrete component: the model, optimizer, schedule, data source
and training objective all come from the resolved spec, and every auxiliary loss or metric
a component reports arrives through the model output's generic side channel."""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmkit import hardware
from llmkit.data.store import PEAKS_FILE, store_root
from llmkit.errors import LlmkitError
from llmkit.parallel.layout import check_layout
from llmkit.runs import (
    PLOT_FILE,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
    build_run_model,
    resume,
)
from llmkit.runs import metrics as metrics_mod
from llmkit.runs.checkpoints import Checkpoints, rng_state, save_weights
from llmkit.runs.lock import RunInUse, RunLock
from llmkit.runs.metrics import RunLog
from llmkit.training import batches
from llmkit.training.distributed import optimizer_order
from llmkit.training.plan import RunPlan
from llmkit.training.progress import ProgressDisplay, StopSignals
from llmkit.training.result import NonFiniteLoss, TrainResult, objective_name, val_line
from llmkit.training.step import StepResult, TrainStep, resolve_precision
from llmkit.training.strategy import ParallelStrategy

#: The most steps whose outcome the host leaves unread (they are read at the next logged,
#: evaluated or checkpointed step, or after this many).
MAX_PENDING = 100


class Trainer:
    """Trains the model a resolved spec describes, writing everything into ``run_dir``."""

    _plotted = -math.inf  # time.monotonic() of the last loss-curve drawing
    _skipped = 0  # consecutive non-finite steps skipped
    _pending: list[StepResult]  # steps taken whose outcome the host has not read yet
    _lock: RunLock | None = None  # held on rank 0 from set-up to the end of fit()

    def __init__(
        self,
        plan: RunPlan,
        *,
        max_time: float | None = None,
        log: Callable[[str], None] = print,
        progress: bool | None = None,
        strategy: ParallelStrategy | None = None,
        on_eval: Callable[[int, float], bool] | None = None,
    ) -> None:
        self.plan = plan
        self.rs = plan.rs
        #: Called after each evaluation with (step, validation loss); True stops the run
        #: there (``stopped = "pruned"``): a hyperparameter search prunes poor trials so.
        self.on_eval = on_eval
        self.run_dir = plan.run_dir
        self.resume = plan.resume
        self.t = plan.rs.spec.train
        self.max_time = max_time if max_time is not None else self.t.max_time
        self.strategy = strategy
        self.log = log
        self.progress = progress
        self.signals = StopSignals(lambda msg: self.log(msg))

    # -- set-up ------------------------------------------------------------------------------
    def _setup(self) -> None:
        from llmkit.data import prepare_data

        t = self.t
        if self.strategy is None:
            self.strategy = ParallelStrategy.setup(t.parallel, t.device, t.dist_timeout)
        strategy = self.strategy
        check_layout(self.plan.rs, strategy.layout)  # before any model or data
        self.log = strategy.quiet_unless_main(self.log)  # rank 0 logs, plots, shows progress
        if not strategy.is_main:
            self.progress = False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock_run()
        if not self.resume and strategy.is_main:
            resume.clear_setup(self.run_dir)  # an earlier run's, left before its step 1
        torch.manual_seed(t.seed)
        self.device = strategy.device
        tokens = t.batch_size * (self.rs.spec.data.block_size or self.rs.model.max_seq_len)
        # ``auto`` may be measured on a CPU: by rank 0 alone, every rank taking its answer.
        measured = tokens if strategy.is_main else None
        self.precision = resolve_precision(t.precision, self.device, self.rs, measured)
        if t.precision == "auto":
            self.precision = strategy.broadcast(self.precision)
        strategy.check_precision(self.precision)
        if self.device.type == "cpu" and t.reuse_freed_memory:
            hardware.reuse_freed_memory()

        plan = self.plan
        with strategy.main_first():  # rank 0 trains the tokenizer and tokenizes first
            if plan.tokenizer_source is not None and strategy.is_main:
                self._adopt_tokenizer(plan.tokenizer_source)
            data = prepare_data(plan.rs, self.run_dir, log=self.log)
        self.data, self.tokenizer = data, data.tokenizer
        line = plan.settle_vocabulary(self.tokenizer)
        if line:
            self.log(line)
        self.rs = plan.rs
        if not self.resume and strategy.is_main:
            plan.save()

        # ≤ max_seq_len: the spec's validation checks it.
        self.block_size = self.rs.spec.data.block_size or self.rs.model.max_seq_len
        self.sampler = batches.training_sampler(
            data,
            self.rs.spec.data.sampling,
            self.block_size,
            t.seed,
            rank=strategy.data_rank,
            world_size=strategy.data_world,
            pin_memory=self.device.type == "cuda",  # copied to the GPU without waiting
            stream_workers=self.rs.spec.data.stream_workers,
        )
        self.sampler = batches.traced(self.sampler, strategy.rank)
        batches.check_validation(data, self.block_size)

        torch.manual_seed(t.seed)  # the same initial weights on every rank
        # (a resumed run restores its own weights: ``init`` is then only an adapted run's base)
        model, lines = build_run_model(self.rs, plan.init)
        for line in lines:
            self.log(line)
        self.model = model.to(self.device)
        self.model.activation_checkpointing = t.activation_checkpointing
        opt = self.rs.optimizer
        if strategy.layout.pp > 1:  # how one process numbers the optimizer's parameters
            whole = opt.build(self.model, opt.options)  # (no state yet: nothing allocated)
            strategy.optimizer_order = optimizer_order(self.model, whole)
        wrapped = strategy.wrap(self.model, t, self.precision)
        line = strategy.describe(t.batch_size, t.grad_accum)
        if line:
            self.log(line)
        self.optimizer = opt.build(strategy.trained(self.model), opt.options)
        sched = self.rs.schedule
        try:
            self.lr_factor = sched.build(sched.options, total_steps=t.max_steps)
        except ValueError as exc:
            raise LlmkitError(f"schedule {sched.name!r}: {exc}") from exc
        self.objective = plan.objective(self.tokenizer, self.device, self.log)
        self.objective.to(self.device)
        self.train_step = TrainStep(
            strategy.trained(self.model),
            self.optimizer,
            objective=self.objective,
            strategy=strategy,
            precision=self.precision,
            grad_accum=t.grad_accum,
            grad_clip=t.grad_clip,
            wrapped=wrapped,
            forward=torch.compile(wrapped) if t.compile else wrapped,
        )
        self.checkpoints = Checkpoints(self.run_dir, keep_steps=t.checkpoint_steps)
        self.metrics = RunLog.for_run(self.rs, self.run_dir)  # metrics.jsonl + train.loggers

        self.step = 0
        self.tokens = 0  # fed to the model (padding included)
        self.trained_tokens = 0  # targets trained on (not -100)
        self.objective_name = objective_name(self.rs)
        self.elapsed = 0.0
        self.best_val: float | None = None
        self.bad_evals = 0
        self.flops_per_token = self.model.flops_per_token(self.block_size)["train"]
        peak = hardware.peak_flops(self.device, self.precision, store_root() / PEAKS_FILE)
        self.peak = peak * strategy.world_size if peak else peak
        if self.resume:
            self._restore()  # last: it sets the RNG state
            if plan.edited and strategy.is_main:
                plan.save()  # the edited recipe is the run's from now on

    def _lock_run(self) -> None:
        """Hold ``<run>/.lock`` for the whole training (rank 0 for the job: every rank shares
        the directory); a second process on the run is refused on every rank."""
        refused: RunInUse | None = None
        if self.strategy.is_main:
            self._lock = RunLock(self.run_dir)
            try:
                self._lock.acquire()
            except RunInUse as exc:
                refused = exc
        problem = self.strategy.broadcast(str(refused) if refused else None)
        if refused is not None:
            raise refused
        if problem:
            raise RunInUse(problem)

    def _adopt_tokenizer(self, source: Path) -> None:
        """Copy the tokenizer the plan adopts (with its config) into the run: a run that
        starts from weights or learns from a teacher must give ids the same meaning."""
        if (self.run_dir / TOKENIZER_FILE).exists():
            return
        for name in TOKENIZER_FILES:
            src = source.parent / name
            if src.is_file():
                shutil.copyfile(src, self.run_dir / name)
        self.log(f"tokenizer: {source}")

    def _restore(self) -> None:
        """Resume from the latest checkpoint, or from the newest older one that is intact when
        a file of the latest cannot be read; the optimizer's hyperparameters come from the
        (possibly edited) spec, its moments from the run."""
        strategy = self.strategy
        ckpt, state, rank_state = resume.newest_readable(self.checkpoints, strategy, self.log)
        resume.check_max_steps(ckpt, state, self.t.max_steps)  # before anything is loaded
        # The (possibly edited) spec's hyperparameters, put back over the loaded state's.
        hypers = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        how = strategy.load_checkpoint(ckpt, self.model, self.optimizer, state)
        for group, hyper in zip(self.optimizer.param_groups, hypers, strict=True):
            group.update(hyper)
        self.sampler.load_state_dict(
            batches.rank_state(state["data"], strategy.data_rank, strategy.data_world)
        )
        change = getattr(self.sampler, "change", None)
        if change:
            self.log(change)
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        # (a checkpoint from before trained tokens were counted: its tokens, all taken as
        # trained)
        trained = state.get("trained_tokens", self.tokens)
        self.trained_tokens = int(trained) if isinstance(trained, int) else self.tokens
        self.elapsed = float(state["elapsed"])
        self.best_val = state.get("best_val")
        self.bad_evals = int(state.get("bad_evals", 0))
        scaler = self.train_step.scaler
        if scaler is not None and "scaler" in state:
            scaler.load_state_dict(state["scaler"])
        resume.restore_rng(state, rank_state, strategy, self.t.seed, self.step)
        if strategy.is_main:
            self.metrics.truncate_after(self.step)
        self.log(f"resumed from {ckpt} at step {self.step}" + (f" ({how})" if how else ""))

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        try:
            return self._fit()
        finally:
            try:
                log = getattr(self, "metrics", None)
                if log is not None:
                    log.close()
                sampler = getattr(self, "sampler", None)
                if sampler is not None:
                    batches.close(sampler)  # a stream's worker processes
            finally:
                if self._lock is not None:
                    self._lock.release()

    def _fit(self) -> TrainResult:
        self._setup()
        t = self.t
        strategy = self.strategy
        if strategy.is_main:
            self.metrics.open()  # a logger that cannot start fails the run before step 1
        self.signals.install()
        history = self.metrics.read()
        self.log(
            f"model: {self.model.num_params():,} parameters, {len(self.model.layers)} layers; "
            f"device {self.device}, precision {self.precision}; "
            f"{batches.token_counts(self.data)}"
        )
        ckpt_every = t.checkpoint_interval or t.eval_interval
        stopped = "max_steps"
        last_val: float | None = None
        self.last_ce: float | None = None
        start_wall = time.perf_counter() - self.elapsed
        interval_t0, interval_tokens, interval_trained = time.perf_counter(), 0, 0
        display = ProgressDisplay(
            t.max_steps, self.step, self.log, self.progress, objective=self.objective_name
        )
        self.log = display.log
        step_tokens = t.batch_size * t.grad_accum * self.block_size * strategy.data_world
        self._pending = []
        try:
            while self.step < t.max_steps:
                self._injected_failure()
                result = self._train_step()
                self._pending.append(result)
                self.step += 1
                self.tokens += step_tokens
                interval_tokens += step_tokens
                self.elapsed = time.perf_counter() - start_wall
                out_of_time, signalled = self._stop_flags()
                if not (result.known or out_of_time or signalled or self._settle_due()):
                    continue  # its outcome is read at the next check point
                # Read the steps since the last check; skipped ones did not count.
                skipped, trained, record = self._settle(step_tokens)
                self.step -= skipped
                self.tokens -= skipped * step_tokens
                interval_tokens -= skipped * step_tokens
                self.trained_tokens += trained
                interval_trained += trained
                if record is None:  # the latest step was skipped
                    continue
                if self.step % t.log_interval == 0 or self.step == t.max_steps:
                    now = time.perf_counter()
                    seconds = max(now - interval_t0, 1e-9)
                    tps = interval_tokens / seconds
                    record.update(
                        tokens=self.tokens,
                        trained_tokens=self.trained_tokens,
                        tokens_per_s=round(tps, 1),
                    )
                    if self.trained_tokens != self.tokens:  # padding or masked prompts
                        record["trained_tokens_per_s"] = round(interval_trained / seconds, 1)
                    record["elapsed"] = round(self.elapsed, 3)
                    interval_t0, interval_tokens, interval_trained = now, 0, 0
                    if self.peak:
                        record["mfu"] = round(self.flops_per_token * tps / self.peak, 4)
                    if strategy.is_main:
                        self.metrics.write(record)
                    history.append(record)
                    display.show(record)
                final = self.step == t.max_steps or out_of_time or signalled
                improved = False  # only a checkpoint evaluated at its own step can be best
                if self.step % t.eval_interval == 0 or final:
                    last_val, improved = self._evaluate(history)
                    if self._early_stop():
                        stopped = "early_stopping"
                        final = True
                    if self.on_eval is not None and not final:
                        verdict = bool(self.on_eval(self.step, last_val))
                        if strategy.any([verdict])[0]:  # rank 0's verdict stops every rank
                            stopped, final = "pruned", True
                due = self.step % ckpt_every == 0 or self.step % t.eval_interval == 0
                if due or final or self.step in t.checkpoint_steps:
                    self._save(best=improved)
                    self._maybe_plot(history, final)
                if out_of_time:
                    stopped = "max_time"
                if signalled:
                    stopped = self.signals.received or "SIGTERM"
                if final:
                    break
        finally:
            display.close()
            self.signals.restore()
        describe = getattr(self.sampler, "describe_shares", None)
        if describe is not None:
            counts = [None if p.train is None else len(p.train) for p in self.data.parts]
            self.log(f"data: mixture shares over the run: {describe(self.block_size, counts)}")
        model = self._finish(history)
        return TrainResult(
            self.run_dir,
            self.step,
            self.tokens,
            self.elapsed,
            stopped,
            last_val,
            self.best_val,
            history,
            strategy.rank,
            strategy.world_size,
            model,
            self.tokenizer if model is not None else None,
            self.rs,
            val_ce=self.last_ce,
            objective=self.objective_name,
            trained_tokens=self.trained_tokens,
            chat_prompt=self._chat_prompt() if model is not None else None,
        )

    def _injected_failure(self) -> None:
        """``LLMKIT_FAIL_AT=RANK:STEP`` makes that rank raise before that step: a test aid
        for a launcher's failure handling (the job must exit non-zero, not hang)."""
        at = os.environ.get("LLMKIT_FAIL_AT")
        rank = self.strategy.rank
        if at and at == f"{rank}:{self.step + 1}":
            raise RuntimeError(f"injected failure on rank {rank} (LLMKIT_FAIL_AT={at})")

    def _stop_flags(self) -> tuple[bool, bool]:
        """(out of time, stop signal received). In a multi-process run, any rank's flag
        stops every rank at the same step (one all-reduce), so none waits alone."""
        out_of_time = self.max_time is not None and self.elapsed >= self.max_time
        signalled = self.signals.received is not None
        out_of_time, signalled = self.strategy.any([out_of_time, signalled])
        return out_of_time, signalled

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sampler.next_batch(self.t.batch_size)

    def _train_step(self) -> StepResult:
        """One optimizer step (:class:`TrainStep`); its outcome may still be on the device."""
        return self.train_step(self._next_batch, self.lr_factor(self.step))

    def _settle_due(self) -> bool:
        """Whether the trainer reads the outcome of the steps taken after the one just
        taken: at a logged, evaluated or checkpointed step, the last one, or when
        :data:`MAX_PENDING` steps are unread."""
        t, step = self.t, self.step
        ckpt_every = t.checkpoint_interval or t.eval_interval
        return (
            step % t.log_interval == 0
            or step % t.eval_interval == 0
            or step % ckpt_every == 0
            or step in t.checkpoint_steps
            or step >= t.max_steps
            or len(self._pending) >= MAX_PENDING
        )

    def _settle(self, step_tokens: int) -> tuple[int, int, dict[str, Any] | None]:
        """Read the outcome of every step taken since the last check (one wait): each
        non-finite one stops the run or is skipped (:meth:`_non_finite`; its update was
        dropped on the device already). Returns how many were skipped, the trained targets
        of those applied (``step_tokens`` each for a step that did not count them), and
        the metrics record of the latest step (None when it was skipped)."""
        pending, self._pending = self._pending, []
        StepResult.read_all(pending)
        first = self.step - len(pending)  # steps counted before them
        skipped = trained = 0
        for i, result in enumerate(pending):
            if result.applied:
                self._skipped = 0
                count = result.trained
                trained += step_tokens if count is None else count
            else:  # it did not count: the steps after it are numbered one lower
                self._non_finite(first + i + 1 - skipped, result.loss, result.grad_norm)
                skipped += 1
        latest = pending[-1]
        if not latest.applied:
            return skipped, trained, None
        record: dict[str, Any] = {
            "step": self.step - skipped,
            "loss": round(latest.loss, 6),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": round(latest.grad_norm, 6),
        }
        record.update({k: round(v, 6) for k, v in latest.reported.items()})
        return skipped, trained, record

    def _last_good(self) -> str:
        latest = self.checkpoints.latest()
        return f"last good checkpoint: {latest}" if latest else "no checkpoint was written yet"

    def _non_finite(self, step: int, loss: float, grad_norm: float) -> None:
        """Step ``step`` had a non-finite loss or gradient (its update was not applied):
        stop the run, or (``on_nonfinite = "skip"``) log the skip, stopping at ten in a row."""
        where = self._last_good()
        what = f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'}"
        if self.t.on_nonfinite == "skip":
            self._skipped += 1
            self.log(f"step {step}: {what} ({loss}), step skipped")
            if self._skipped < 10:
                return
            raise NonFiniteLoss(f"10 consecutive steps with a {what}; stopped ({where})")
        raise NonFiniteLoss(
            f"{what} at step {step} (loss {loss}, grad norm {grad_norm}); stopped "
            f"without saving ({where}); lower the lr or set train.on_nonfinite='skip'"
        )

    def _evaluate(self, history: list[dict[str, Any]]) -> tuple[float, bool]:
        """The objective on the validation set and whether it is the best so far; the
        cross-entropy beside it (``self.last_ce``). "Best", early stopping and ``on_eval``
        follow the objective, the quantity minimized (the cross-entropy is what the log
        and ``llmkit compare`` lead with). A mixture is evaluated on each source
        (``val_loss/<name>``, ``val_ce/<name>``, the evaluation batches shared out among
        them) and on their mix, the per-source losses weighted as training draws them."""
        t = self.t
        sets = batches.validation_sets(self.data)
        per_source: dict[str, float] = {}
        if len(sets) == 1:
            loss, ce = self._validation_loss(sets[0].tokens, t.eval_batches)
        else:  # a mixture: each source, and the mix weighted as training draws it
            n = max(1, math.ceil(t.eval_batches / len(sets)))
            loss = ce = 0.0
            for v in sets:
                part_loss, part_ce = self._validation_loss(v.tokens, n)
                loss, ce = loss + v.weight * part_loss, ce + v.weight * part_ce
                per_source[f"val_loss/{v.name}"] = round(part_loss, 6)
                per_source[f"val_ce/{v.name}"] = round(part_ce, 6)
            shares = getattr(self.sampler, "shares", dict)()  # of the rows drawn so far
            per_source.update({f"share/{k}": round(v, 6) for k, v in shares.items()})
        if not math.isfinite(loss):  # never "best", never saved
            if self.strategy.is_main:
                self.metrics.write({"step": self.step, "val_loss": loss})
            raise NonFiniteLoss(
                f"non-finite validation loss ({loss}) at step {self.step}; stopped without "
                f"saving ({self._last_good()})"
            )
        improved = self.best_val is None or loss < self.best_val
        if improved:
            self.best_val, self.bad_evals = loss, 0
        else:
            self.bad_evals += 1
        self.last_ce = ce
        # val_ce and val_ppl: the cross-entropy, whatever the objective; val_loss and
        # best_val_loss: the objective (the same number as val_ce for the cross-entropy).
        record: dict[str, Any] = {
            "step": self.step,
            "val_loss": round(loss, 6),
            "val_ce": round(ce, 6),
            "val_ppl": round(math.exp(min(ce, 80.0)), 4),
            "best_val_loss": round(self.best_val, 6),
            **per_source,
        }
        if self.strategy.is_main:
            self.metrics.write(record)
        history.append(record)
        self.log(
            f"step {self.step}: "
            f"{val_line(ce, loss, self.objective_name)}{' (best)' if improved else ''}"
            + "".join(
                f"; {k.split('/', 1)[1]} {v:.4f}"
                for k, v in per_source.items()
                if k.startswith("val_ce/")
            )
        )
        return loss, improved

    def _validation_loss(self, tokens: Any, n_batches: int) -> tuple[float, float]:
        """The objective and the cross-entropy on ``n_batches`` validation batches of
        ``tokens``: the single-process evaluation set (batches of batch_size × world_size
        blocks), each batch's rows dealt out to the ranks, the token-weighted sums added."""
        from llmkit.data import eval_batches
        from llmkit.evaluation.perplexity import evaluate_batches

        t, strategy = self.t, self.strategy
        rows = eval_batches(tokens, self.block_size, t.batch_size * strategy.data_world, n_batches)
        counted, padding = strategy.eval_shares(rows)
        amp = hardware.autocast(self.device, self.precision)
        if strategy.pipelined is not None:  # the last stage's ranks score; all run
            with amp:
                strategy.pipelined.evaluate(padding)
                local = strategy.pipelined.evaluate(counted)
            total, count = strategy.sum(list(local))
            ce = total / max(count, 1)  # the objective is the cross-entropy under pp
            return ce, ce
        if padding:
            evaluate_batches(self.model, padding, self.device, amp, self.objective)
        res = evaluate_batches(self.model, counted, self.device, amp, self.objective)
        total, ce_total, count = strategy.sum(
            [res.loss * res.tokens, res.ce * res.tokens, res.tokens]
        )
        return total / max(count, 1), ce_total / max(count, 1)

    def _early_stop(self) -> bool:
        patience = self.t.early_stopping_patience
        return patience is not None and self.bad_evals >= patience

    def _weights_finite(self) -> bool:
        """Whether every weight is finite, on every rank (each checks its own shards)."""
        params = self.train_step.model.parameters()  # this rank's (a pipeline: its stages)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        ok = all(bool(torch.isfinite(p.detach()).all()) for p in local)
        return not self.strategy.any([not ok])[0]

    def _save(self, best: bool) -> None:
        if not self._weights_finite():
            raise NonFiniteLoss(
                f"non-finite weights after step {self.step}; stopped without saving "
                f"({self._last_good()})"
            )
        state: dict[str, Any] = {
            "data": batches.gathered_state(self.sampler, self.strategy),
            "rng": rng_state(),
            "step": self.step,
            "tokens": self.tokens,
            "trained_tokens": self.trained_tokens,
            "elapsed": self.elapsed,
            "best_val": self.best_val,
            "bad_evals": self.bad_evals,
        }
        if self.train_step.scaler is not None:
            state["scaler"] = self.train_step.scaler.state_dict()
        meta = {"tokens": self.tokens, "best_val_loss": self.best_val}
        self.strategy.save_checkpoint(
            self.checkpoints,
            self.step,
            self.model,
            self.optimizer,
            state,
            meta,
            best=best,
            full_model=self._full_model(),
        )

    def _full_model(self) -> nn.Module | None:
        """The whole model with current weights on rank 0 (None elsewhere)."""
        return self.strategy.full_model(
            self.model, lambda: build_run_model(self.rs, load_base=False)[0]
        )

    def _maybe_plot(self, history: list[dict[str, Any]], final: bool) -> None:
        """Redraw the loss curve at a checkpoint at most every ``PLOT_EVERY_S`` seconds."""
        now = time.monotonic()
        due = now - self._plotted >= metrics_mod.PLOT_EVERY_S
        if self.t.plot and self.strategy.is_main and not final and due:
            metrics_mod.plot_losses(history, self.run_dir / PLOT_FILE, self.rs.spec.name or "")
            self._plotted = now

    def _chat_prompt(self) -> list[int] | None:
        """A chat run's first validation conversation up to its first trained target (its
        system and user turns and the generation prompt), for the end-of-training sample;
        None for text, or a conversation trained from its start (``mask_prompt = false``)."""
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        val = self.data.validation
        mask, bounds = val.mask, val.doc_bounds
        if mask is None or bounds is None or len(bounds) < 2:
            return None
        start, end = int(bounds[0]), int(bounds[1])
        trained = mask[start:end].nonzero()[0]
        if not len(trained) or trained[0] < 2:
            return None
        return [int(i) for i in val.array[start : start + int(trained[0])]]

    def _finish(self, history: list[dict[str, Any]]) -> nn.Module | None:
        """Final weights and loss curve; the whole model on rank 0 (None elsewhere)."""
        model = self._full_model()
        if self.strategy.is_main:
            save_weights(model, self.run_dir / "model.safetensors")
            if self.t.plot:
                metrics_mod.plot_losses(history, self.run_dir / PLOT_FILE, self.rs.spec.name or "")
        return model
