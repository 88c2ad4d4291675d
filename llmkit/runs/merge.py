"""``merge-lora``: a run with adapters written out as a plain run with merged weights.

The new run directory holds the spec without ``model.adapter`` and ``train.init_from``, the
merged full weights, and the tokenizer files; it generates and evaluates exactly as the
adapted run does (up to float rounding of W + ΔW), needs neither the adapters nor the base
run any more, and can itself be a ``train.init_from`` source.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

from llmkit.errors import LlmkitError
from llmkit.runs import (
    ADAPTER_SECTION,
    SPEC_FILE,
    TOKENIZER_FILES,
    check_empty_output,
    load_run,
    save_spec,
)
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.spec import resolve


def merge_run(path: str | Path, out: str | Path, which: str = "final") -> tuple[Path, int]:
    """Merge the adapters of the run at ``path`` (its ``which`` weights) into a new run at
    ``out`` (absent or empty); returns (``out``, the number of layers merged)."""
    from llmkit.model.adapters import merge_adapters

    out = Path(out)
    check_empty_output(out)
    loaded = load_run(path, which=which)
    if ADAPTER_SECTION not in loaded.spec.components:
        raise LlmkitError(f"{loaded.run_dir} has no adapters (model.adapter) to merge")
    merged = merge_adapters(loaded.model)
    raw = copy.deepcopy(loaded.spec.raw)
    raw.get("model", {}).pop("adapter", None)
    for key in ("init_from", "init_resize_vocab"):
        raw.get("train", {}).pop(key, None)
    rs = resolve(raw, source=str(out / SPEC_FILE))
    out.mkdir(parents=True, exist_ok=True)
    save_spec(rs, out)
    for name in TOKENIZER_FILES:
        src = loaded.run_dir / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    save_weights(loaded.model, out / WEIGHTS)
    return out, merged
