"""``train(...)``: the entry point that ``llmkit train`` calls — a new run from a spec file, or
a resumed run from its directory (with ``--set`` edits), on one process or under torchrun."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmkit.training.plan import log_notes, plan_run
from llmkit.training.result import TrainResult
from llmkit.training.strategy import ParallelStrategy
from llmkit.training.trainer import Trainer


def train(
    spec_path: str | Path | None = None,
    *,
    run_dir: str | Path | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    max_steps: int | None = None,
    max_time: float | None = None,
    log: Callable[[str], None] = print,
    progress: bool | None = None,
    on_eval: Callable[[int, float], bool] | None = None,
) -> TrainResult:
    """Train from a spec file, or resume the run in ``run_dir``: the spec is read and resolved
    once, into a :class:`~llmkit.training.plan.RunPlan`. ``max_steps`` cuts the run (a longer
    warmup is scaled down to fit, with a note). ``on_eval(step, val_loss)`` is called after
    every evaluation but the last; True stops the run there (pruning)."""
    plan = plan_run(
        spec_path, run_dir=run_dir, overrides=overrides, resume=resume, max_steps=max_steps
    )
    log_notes(plan)
    t = plan.train
    strategy = ParallelStrategy.setup(t.parallel, t.device, t.dist_timeout)
    # rank 0's (time-stamped) choice of directory for everyone
    plan.run_dir = Path(strategy.broadcast(str(plan.run_dir)))
    trainer = Trainer(
        plan,
        max_time=max_time,
        log=log,
        progress=progress,
        strategy=strategy,
        on_eval=on_eval,
    )
    return trainer.fit()
