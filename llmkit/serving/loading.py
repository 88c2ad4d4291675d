"""What ``llmkit serve`` serves: a run (or one of its checkpoints) or a local Hugging Face
checkpoint directory, loaded once, checked and optionally converted (bf16, int8)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmkit.errors import LlmkitError


@dataclass
class Served:
    """The model to serve, its tokenizer (None: token-id prompts only) and its name."""

    model: Any
    tokenizer: Any
    name: str
    params: int = 0  # parameters before any conversion (int8 layers hold theirs as buffers)


def is_hf_dir(path: Path) -> bool:
    """A Hugging Face checkpoint directory (config.json) that is not an llmkit run."""
    from llmkit.runs import SPEC_FILE

    return (path / "config.json").is_file() and not (path / SPEC_FILE).is_file()


def load_served(
    source: str | Path,
    *,
    weights: str = "final",
    device: torch.device | str = "cpu",
    dtype: str | None = None,
) -> Served:
    """Load ``source`` (a run or checkpoint directory, or a Hugging Face directory, read
    through ``llmkit import-hf`` into a temporary run) onto ``device``; ``dtype`` is a
    ``--quantize`` method of ``llmkit generate`` (``bf16``, ``int8``, ...) or None/``float32``
    (the weights as loaded)."""
    from llmkit.inference.checks import check_weights
    from llmkit.runs import load_run

    path = Path(source).expanduser()
    if not path.exists():
        raise LlmkitError(f"{path}: no such run or Hugging Face directory")
    if is_hf_dir(path):
        from llmkit.interop.runs import import_hf

        with tempfile.TemporaryDirectory(prefix="llmkit-serve-") as tmp:
            out = Path(tmp) / "run"
            import_hf(path, out)
            run = load_run(out, device=str(device))
    else:
        run = load_run(path, which=weights, device=str(device))
    try:
        check_weights(run.model, run.weights if not is_hf_dir(path) else path)
    except ValueError as exc:
        raise LlmkitError(str(exc)) from exc
    model = run.model
    params = sum(p.numel() for p in model.parameters())
    if dtype and dtype != "float32":
        from llmkit.inference.quantize import quantize_model

        try:
            model = quantize_model(model, dtype)
        except ValueError as exc:
            raise LlmkitError(str(exc)) from exc
    name = path.name if is_hf_dir(path) else Path(run.run_dir).name
    return Served(model.eval(), run.tokenizer, name, params)
