"""Branching a run at one of its checkpoints: a new run directory that resumes from there.

:func:`branch_run` makes ``dst`` a run whose only (and latest) checkpoint is ``src``'s at
``step``, with ``src``'s spec, tokenizer and tokenized data, and its metrics up to that
step. Resuming it (``train(None, run_dir=dst, resume=True, overrides=[...])``, or
``llmkit train --resume DST --set ...``) continues exactly where ``src`` was at ``step``:
the weights, optimizer moments, data position and random state are the checkpoint's. With
``train.max_steps = T`` on a warmup-stable-decay run this trains the cooldown of a
``T``-step run off the long run's stable phase (see docs/experiments.md).

``dst`` is written under a temporary name and renamed into place; ``src`` is only read
(its tokenized data is hard-linked where the file system allows, else copied).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from llmkit.data.store import link_or_copy
from llmkit.errors import LlmkitError
from llmkit.files import write_json_atomic as _write_json
from llmkit.runs import METRICS_FILE, RESOLVED_FILE, SPEC_FILE, TOKENIZER_FILES
from llmkit.runs.checkpoints import CHECKSUMS, Checkpoints, read_meta, verify_files

#: Written into a branch: where it came from (``{"source": ..., "step": ...}``).
BRANCH_FILE = "branch.json"
DATA_DIR = "data"


def branch_run(src: str | Path, step: int, dst: str | Path) -> Path:
    """Make ``dst`` a run directory whose latest checkpoint is ``src``'s checkpoint at
    ``step``; :class:`LlmkitError` when ``src`` has no such checkpoint or ``dst`` exists.
    ``train.checkpoint_steps`` past ``step`` are dropped from the branch's spec (they are
    ``src``'s plan, and may lie beyond the branch's ``max_steps``). Returns ``dst``."""
    src, dst = Path(src), Path(dst)
    if not (src / SPEC_FILE).is_file():
        raise LlmkitError(f"{src} is not a run directory (no {SPEC_FILE})")
    name = f"step-{step:06d}"
    ckpt = Checkpoints(src).dir / name
    if not ckpt.is_dir():
        have = ", ".join(str(int(p.name[5:])) for p in Checkpoints(src).steps()) or "none"
        raise LlmkitError(
            f"{src} has no checkpoint at step {step} (it has: {have}); save one there with "
            "train.checkpoint_steps"
        )
    if dst.exists() or dst.is_symlink():
        raise LlmkitError(f"{dst} exists; a branch needs a new directory")
    meta = read_meta(ckpt)
    tmp = dst.with_name(f".{dst.name}.tmp-branch")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _copy_setup(src, tmp, step)
        (tmp / "checkpoints").mkdir()
        shutil.copytree(ckpt, tmp / "checkpoints" / name)
        verify_files(tmp / "checkpoints" / name, meta.get(CHECKSUMS, {}))  # copied intact
        pointer = {k: v for k, v in meta.items() if k not in ("step", CHECKSUMS)}
        _write_json(tmp / "checkpoints" / "latest.json", {"step": step, "dir": name, **pointer})
        _write_json(tmp / BRANCH_FILE, {"source": str(src.absolute()), "step": step})
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _copy_setup(src: Path, dst: Path, step: int) -> None:
    """The spec (its ``checkpoint_steps`` past ``step`` dropped), the resolved spec, the
    tokenizer files, the tokenized data (hard links) and the metrics up to ``step``."""
    raw = yaml.safe_load((src / SPEC_FILE).read_text())
    if _drop_later_steps(raw, step):
        (dst / SPEC_FILE).write_text(yaml.safe_dump(raw, sort_keys=False))
    else:
        shutil.copyfile(src / SPEC_FILE, dst / SPEC_FILE)
    if (src / RESOLVED_FILE).is_file():
        resolved = json.loads((src / RESOLVED_FILE).read_text())
        _drop_later_steps(resolved, step, keep_key=True)  # every default spelled out
        (dst / RESOLVED_FILE).write_text(json.dumps(resolved, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    if (src / DATA_DIR).is_dir():
        shutil.copytree(src / DATA_DIR, dst / DATA_DIR, copy_function=link_or_copy)
    metrics = src / METRICS_FILE
    if metrics.is_file():
        kept = [line for line in metrics.read_text().splitlines(keepends=True) if _upto(line, step)]
        (dst / METRICS_FILE).write_text("".join(kept))


def _drop_later_steps(data: Any, step: int, *, keep_key: bool = False) -> bool:
    """Remove ``train.checkpoint_steps`` entries past ``step`` from a spec table (the key
    itself when none is left, unless ``keep_key``); whether anything changed."""
    train = data.get("train") if isinstance(data, dict) else None
    steps = train.get("checkpoint_steps") if isinstance(train, dict) else None
    if not isinstance(steps, list):
        return False
    kept = [s for s in steps if isinstance(s, int) and s <= step]
    if kept == steps:
        return False
    if kept or keep_key:
        train["checkpoint_steps"] = kept
    else:
        del train["checkpoint_steps"]
    return True


def _upto(line: str, step: int) -> bool:
    """Whether a metrics line belongs to the run up to ``step`` (lines that are not records
    are dropped, as a resume drops them)."""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and record.get("step", 0) <= step
