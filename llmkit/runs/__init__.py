"""Run directories: creating them, saving the spec, and loading a trained model back."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmkit.runs.checkpoints import WEIGHTS, Checkpoints, load_weights
from llmkit.errors import LlmkitError
from llmkit.spec import ResolvedSpec, load_spec

SPEC_FILE = "spec.yaml"  # the merged spec (extends and --set applied); reloadable
RESOLVED_FILE = "resolved.json"  # every default and every layer's component spelled out
TOKENIZER_FILE = "tokenizer.json"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


def default_run_dir(rs: ResolvedSpec) -> Path:
    name = rs.spec.name or Path(rs.source or "run").stem
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def save_spec(rs: ResolvedSpec, run_dir: Path) -> None:
    (run_dir / SPEC_FILE).write_text(yaml.safe_dump(rs.raw, sort_keys=False))
    (run_dir / RESOLVED_FILE).write_text(json.dumps(rs.to_dict(), indent=2) + "\n")


@dataclass
class LoadedRun:
    spec: ResolvedSpec
    model: Any
    tokenizer: Any
    weights: Path
    run_dir: Path


def find_weights(path: Path, which: str = "final") -> tuple[Path, Path]:
    """(run_dir, weights file) for a run directory or a checkpoint directory."""
    if which == "final" and (path / WEIGHTS).is_file() and (path / SPEC_FILE).is_file():
        return path, path / WEIGHTS
    if (path / WEIGHTS).is_file() and (path.parent.parent / SPEC_FILE).is_file():
        return path.parent.parent, path / WEIGHTS  # <run>/checkpoints/step-N
    if (path / SPEC_FILE).is_file():
        ckpts = Checkpoints(path)
        chosen = ckpts.best() if which == "best" else ckpts.latest()
        if chosen is None and which == "best":
            chosen = ckpts.latest()
        if chosen is not None:
            return path, chosen / WEIGHTS
        raise LlmkitError(f"{path}: the run has no weights yet")
    raise LlmkitError(f"{path} is not a run directory or checkpoint (no {SPEC_FILE})")


def load_run(path: str | Path, which: str = "final", device: str = "cpu") -> LoadedRun:
    """Rebuild the model of a run from its spec and load its weights and tokenizer."""
    from llmkit.model import build_model
    from llmkit.data.tokenizer import Tokenizer

    p = Path(path)
    if not p.exists():
        raise LlmkitError(f"run not found: {p}")
    run_dir, weights = find_weights(p, which)
    rs = load_spec(run_dir / SPEC_FILE)
    model = build_model(rs)
    load_weights(model, weights)
    model.to(device).eval()
    specials = rs.spec.tokenizer.special_tokens
    tokenizer = Tokenizer.load(
        run_dir / TOKENIZER_FILE, eos_token=specials[0] if specials else None
    )
    return LoadedRun(rs, model, tokenizer, weights, run_dir)
