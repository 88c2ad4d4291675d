"""What a training run reports: how it ended (:class:`TrainResult`), what it minimizes
(:func:`objective_name`), the validation line it logs, and the error that stops it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from llmkit.errors import LlmkitError
from llmkit.model.objective import LOSS_SECTION
from llmkit.spec import ResolvedSpec

__all__ = ["CROSS_ENTROPY", "NonFiniteLoss", "TrainResult", "objective_name", "val_line"]


class NonFiniteLoss(LlmkitError):
    """The loss or gradient became NaN/inf."""


#: The name of the model's own cross-entropy as an objective.
CROSS_ENTROPY = "cross_entropy"


def objective_name(rs: ResolvedSpec) -> str:
    """What a run minimizes, in a word: ``cross_entropy`` (no ``train.loss``), the
    ``train.loss`` component's name, ``distill`` (``train.distill`` over the
    cross-entropy) or ``distill(<that name>)``."""
    loss = rs.components.get(LOSS_SECTION)
    base = loss.name if loss is not None else CROSS_ENTROPY
    if rs.spec.train.distill is not None:
        return "distill" if loss is None else f"distill({base})"
    return base


@dataclass
class TrainResult:
    """How a run ended. On rank 0, ``model`` is the trained model in memory (the weights just
    saved as ``model.safetensors``; under FSDP a gathered CPU copy) with its ``tokenizer``
    and resolved ``spec``, so the end-of-training sample needs no reload; None elsewhere.

    ``val_ce`` is the last evaluation's cross-entropy (what compares across objectives;
    ``val_ppl`` is its exponential); ``val_loss`` and ``best_val_loss`` are the objective
    (``objective`` names it), which the best checkpoint, early stopping and ``on_eval``
    follow; both are the same number when the objective is the cross-entropy. ``tokens``
    counts the tokens fed to the model, ``trained_tokens`` the targets trained on (not
    -100: padding and masked prompts excluded)."""

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
    model: nn.Module | None = None
    tokenizer: Any = None
    spec: ResolvedSpec | None = None
    val_ce: float | None = None
    objective: str = CROSS_ENTROPY
    trained_tokens: int | None = None
    #: A chat run's first validation conversation up to its first trained token (its
    #: system and user turns and the assistant's generation prompt), for the sample.
    chat_prompt: list[int] | None = None

    @property
    def val_ppl(self) -> float | None:
        return None if self.val_ce is None else math.exp(min(self.val_ce, 80.0))


def val_line(ce: float, loss: float, objective: str) -> str:
    """``val ce 4.1234 (ppl 61.76)``, and ``, objective distill 3.3200`` beside it when the
    objective is not the cross-entropy: the number that compares across runs first."""
    line = f"val ce {ce:.4f} (ppl {math.exp(min(ce, 80.0)):.2f})"
    if objective != CROSS_ENTROPY:
        line += f", objective {objective} {loss:.4f}"
    return line
