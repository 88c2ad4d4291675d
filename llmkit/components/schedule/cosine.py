"""Linear warmup then cosine decay to a floor (Loshchilov & Hutter 2017, SGDR)."""

from __future__ import annotations

from collections.abc import Callable

from llmkit.components.schedule import warmup_then_decay
from llmkit.components.schedule.options import CosineOptions as Options


def build(options: Options, *, total_steps: int, base_lr: float = 1.0) -> Callable[[int], float]:
    """Return ``step -> base_lr · factor``: warmup, cosine from 1 at ``warmup_steps`` to
    ``min_lr_ratio`` at ``total_steps``, then ``min_lr_ratio`` (nanoGPT's ``get_lr``)."""
    return warmup_then_decay(options, total_steps, base_lr, "cosine", "cosine")
