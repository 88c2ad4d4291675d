"""``train(...)``: the entry point that ``llmkit train`` calls — a new run from a spec file, or
a resumed run from its directory (with ``--set`` edits), on one process or under torchrun."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmkit.errors import LlmkitError, SpecError
from llmkit.model import build_problems
from llmkit.runs import default_run_dir, open_run
from llmkit.runs.checkpoints import Checkpoints
from llmkit.spec import load_spec
from llmkit.training import resume as resume_mod
from llmkit.training.strategy import ParallelStrategy
from llmkit.training.trainer import Trainer, TrainResult


def train(
    spec_path: str | Path | None = None,
    *,
    run_dir: str | Path | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    max_time: float | None = None,
    log: Callable[[str], None] = print,
    progress: bool | None = None,
    on_eval: Callable[[int, float], bool] | None = None,
) -> TrainResult:
    """Train from a spec file, or resume the run in ``run_dir``. The spec is resolved once.
    ``on_eval(step, val_loss)`` is called after every evaluation but the last; True stops
    the run there (pruning)."""
    if resume:
        if run_dir is None:
            raise LlmkitError("--resume needs the run directory")
        run = open_run(run_dir)
        if run.checkpoint is not None:
            raise LlmkitError(f"{run_dir} is a checkpoint; resume its run: --resume {run.dir}")
        if not Checkpoints(run.dir).newest_first():  # before any data is read
            raise resume_mod.nothing_to_resume(run.dir)
        rs = run.resolve(overrides or [])
        if overrides:  # against the saved spec as written, not resolved again
            resume_mod.check_same_optimizer(run.raw, rs)
        rd = run.dir
    else:
        if spec_path is None:
            raise LlmkitError("a spec file is required (or --resume RUN_DIR)")
        rs = load_spec(spec_path, overrides or [])
        found = build_problems(rs)  # before the data is read: a model that cannot be built
        if found:
            raise SpecError(found, str(spec_path))
        rd = Path(run_dir) if run_dir else default_run_dir(rs)
        resume_mod.check_new_run_dir(rd)
    t = rs.spec.train
    strategy = ParallelStrategy.setup(t.parallel, t.device, t.dist_timeout)
    rd = Path(strategy.broadcast(str(rd)))  # rank 0's (time-stamped) choice for everyone
    trainer = Trainer(
        rs,
        rd,
        resume=resume,
        edited=bool(resume and overrides),
        max_time=max_time,
        log=log,
        progress=progress,
        strategy=strategy,
        on_eval=on_eval,
    )
    return trainer.fit()
