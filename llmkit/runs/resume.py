"""Starting and restarting runs, next to the run directory they read: which directory a new
run may use, and which checkpoint every rank resumes from (each file checked before a byte of
it is loaded). The ranks are described by a :class:`Ranks` (training's ``ParallelStrategy``)."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from llmkit.errors import LlmkitError
from llmkit.runs import RESOLVED_FILE, SPEC_FILE, TOKENIZER_FILES
from llmkit.runs.checkpoints import (
    SHARDS,
    STATE,
    WEIGHTS,
    Checkpoints,
    DamagedCheckpoint,
    load_state,
    load_tensors,
    rank_file,
    set_rng_state,
    shard_files,
    verify_files,
    weight_shapes,
)
from llmkit.runs.lock import LOCK_FILE


class Ranks(Protocol):
    """The processes of a job, as resuming needs them (``ParallelStrategy`` is one)."""

    @property
    def rank(self) -> int: ...

    @property
    def is_main(self) -> bool: ...

    @property
    def distributed(self) -> bool: ...

    @property
    def sharded(self) -> bool: ...

    def sum(self, values: list[float]) -> Any: ...


#: What a run writes before its first step: a directory holding only these (and llmkit's
#: resolved.json among them) is a run that stopped before training, and may start again.
SETUP_FILES = {SPEC_FILE, RESOLVED_FILE, *TOKENIZER_FILES, "data"}


def restartable(rd: Path) -> bool:
    """True for an empty directory, or one a run left before its first step."""
    names = {p.name for p in rd.iterdir()} - {LOCK_FILE}
    return not names or (RESOLVED_FILE in names and names <= SETUP_FILES)


def check_new_run_dir(rd: Path) -> None:
    """A new run may use ``rd`` only if it is absent, empty, or left before a first step."""
    if (rd / "checkpoints").exists():
        raise LlmkitError(
            f"{rd} already holds a run; resume it with --resume {rd} or choose another --out"
        )
    if rd.exists() and (not rd.is_dir() or not restartable(rd)):
        raise LlmkitError(
            f"{rd} exists and is not an empty directory; training would overwrite its "
            "files (a run that stopped before its first checkpoint leaves such a directory): "
            "remove it or choose another --out"
        )


def clear_setup(rd: Path) -> None:
    """Remove what an earlier run left in ``rd`` before its first step: the new run's spec
    may ask for another tokenizer or data, and must not find the old ones there. Called by
    the new run once it holds the run's lock (a run still setting up holds it)."""
    for name in SETUP_FILES:
        path = rd / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def check_max_steps(ckpt: Path, state: dict[str, Any], max_steps: int) -> None:
    """A resume must be allowed to reach past the step the run is at."""
    if max_steps < int(state["step"]):
        raise LlmkitError(
            f"{ckpt.name}: the run is at step {int(state['step'])} and train.max_steps "
            f"is {max_steps}; raise it (--max-steps N) to train further"
        )


def read_checkpoint(ckpt: Path, strategy: Ranks) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The trainer state and this rank's own state of ``ckpt``, after checking every file this
    rank will read against the checksums in ``meta.json``, the state's fields, and that the
    weights file reads (header only); :class:`DamagedCheckpoint` when one does not."""
    state = load_state(ckpt)
    reads = getattr(strategy, "reads_shards", None)
    from_shards = (reads(ckpt, state) if reads is not None else strategy.sharded) and (
        ckpt / SHARDS
    ).is_dir()
    own = rank_file(strategy.rank)
    check_state(state, ckpt / STATE)
    if not from_shards:
        weight_shapes(ckpt / WEIGHTS)
    verify_files(ckpt, [STATE, own, *(shard_files(ckpt) if from_shards else [WEIGHTS])])
    rank_state = None
    if strategy.distributed and (ckpt / own).is_file():
        rank_state = load_tensors(ckpt / own, "rank state")
        if not isinstance(rank_state, dict):
            raise DamagedCheckpoint(f"{ckpt / own}: not a table of rank state")
        _check_rng(rank_state.get("rng"), ckpt / own)
    return state, rank_state


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _position(value: Any, depth: int = 0) -> bool:
    """A sampler's position: tables and lists (a mixture's per source, a stream's per
    worker) down to counts, finite numbers and strings."""
    if depth > 16:
        return False
    if isinstance(value, dict):
        return all(isinstance(k, str) and _position(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_position(v, depth + 1) for v in value)
    return _count(value) or _number(value) or isinstance(value, str)


def check_state(state: Any, path: Path) -> None:
    """A ``state.pt`` that loaded must hold what the trainer restores, with the right types:
    :class:`DamagedCheckpoint` naming the first field that does not."""

    def bad(field: str, what: str) -> DamagedCheckpoint:
        return DamagedCheckpoint(f"{path}: {field} {what}")

    if not isinstance(state, dict):
        raise bad("the trainer state", f"is a {type(state).__name__}, not a table")
    for key in ("step", "tokens"):
        if key not in state:
            raise bad(key, "is missing")
        if not _count(state[key]):
            raise bad(key, f"is {state[key]!r}, not a count")
    if not (_number(state.get("elapsed")) and state["elapsed"] >= 0):
        raise bad("elapsed", f"is {state.get('elapsed')!r}, not a number of seconds")
    data = state.get("data")
    if not isinstance(data, dict) or not _position(data):
        raise bad("data", f"is {data!r}, not a data position")
    best = state.get("best_val")
    if best is not None and not _number(best):
        raise bad("best_val", f"is {best!r}, not a finite number")
    if not _count(state.get("bad_evals", 0)):
        raise bad("bad_evals", f"is {state.get('bad_evals')!r}, not a count")
    for key in ("optimizer", "scaler"):
        if key in state and not isinstance(state[key], dict):
            raise bad(key, f"is a {type(state[key]).__name__}, not a table")
    _check_rng(state.get("rng"), path)


def _check_rng(rng: Any, path: Path) -> None:
    """The random states :func:`~llmkit.runs.checkpoints.set_rng_state` restores."""
    problem = None
    if not isinstance(rng, dict):
        problem = "is missing" if rng is None else f"is a {type(rng).__name__}, not a table"
    elif not (isinstance(rng.get("torch"), torch.Tensor) and rng["torch"].dtype == torch.uint8):
        problem = "has no torch state"
    elif not (
        isinstance(rng.get("python"), list | tuple)
        and all(isinstance(v, int) for v in rng["python"])
        and isinstance(rng.get("python_version"), int)
    ):
        problem = "has no Python state"
    else:
        n = rng.get("numpy")
        if not (
            isinstance(n, dict)
            and isinstance(n.get("keys"), torch.Tensor)
            and all(isinstance(n.get(k), int) for k in ("pos", "has_gauss"))
            and isinstance(n.get("cached"), int | float)
        ):
            problem = "has no NumPy state"
    if problem:
        raise DamagedCheckpoint(f"{path}: rng {problem}")


def nothing_to_resume(run: Path) -> LlmkitError:
    """The error for a run without checkpoints (one that never saved, or an imported one)."""
    return LlmkitError(
        f"{run}: no checkpoint to resume from; to train from its weights as a new run: "
        f"llmkit train {run / 'spec.yaml'} --init-from {run} --out NEW_RUN"
    )


def newest_readable(
    checkpoints: Checkpoints, strategy: Ranks, log: Callable[[str], None]
) -> tuple[Path, dict[str, Any], dict[str, Any] | None]:
    """The latest checkpoint, or the newest older one that is intact when a file of the
    latest cannot be read, with its state and this rank's state. Every rank must resume from
    the same checkpoint: one rank's unreadable file moves them all to the next. A missing or
    damaged ``latest.json`` is noted in one line (the newest checkpoint is used)."""
    candidates = checkpoints.newest_first()
    if not candidates:
        raise nothing_to_resume(checkpoints.dir.parent)
    pointer = checkpoints.pointer_problem("latest")
    if pointer:
        log(f"note: {pointer}; using the newest checkpoint, {candidates[0].name}")
    for i, ckpt in enumerate(candidates):
        problem: DamagedCheckpoint | None = None
        try:
            state, rank_state = read_checkpoint(ckpt, strategy)
        except DamagedCheckpoint as exc:
            problem = exc
        bad = int(strategy.sum([1.0 if problem else 0.0])[0])
        if not bad:
            return ckpt, state, rank_state
        why = str(problem) if problem else f"{ckpt} cannot be read on {bad} other rank(s)"
        if i + 1 == len(candidates):
            raise problem or DamagedCheckpoint(why)
        log(f"warning: {why}; resuming from {candidates[i + 1].name} instead")
    raise AssertionError("unreachable")  # pragma: no cover


def restore_rng(
    state: dict[str, Any],
    rank_state: dict[str, Any] | None,
    strategy: Ranks,
    seed: int,
    step: int,
) -> None:
    """Each rank's random streams as saved; a rank the saving run did not have draws a
    fresh stream of its own."""
    if rank_state is not None:
        set_rng_state(rank_state["rng"])
    elif strategy.is_main:
        set_rng_state(state["rng"])
    else:
        torch.manual_seed(seed + 1000 * strategy.rank + step)
