"""Knowledge distillation as a training objective (``[train.distill]``).

The teacher is another run's model, frozen and in eval mode; its logits are computed under
``torch.no_grad`` (no activation is kept for backward). The student's loss is

    α · T² · KL(softmax(z_teacher / T) ‖ softmax(z_student / T)) + (1 − α) · hard

where ``hard`` is the run's own objective (its cross-entropy, or the ``train.loss``
component) and the KL is the mean over predicted (not ignored) tokens. The T² factor keeps
the soft term's gradients on the scale of the hard term's as T changes (Hinton, Vinyals and
Dean 2015, "Distilling the Knowledge in a Neural Network"). Each step logs both parts as
``metric/distill.kl`` and ``metric/distill.hard``.

Teacher and student must share a tokenizer; a new student run takes the teacher's when its
spec names none (:func:`teacher_tokenizer`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.errors import LlmkitError
from llmkit.model.objective import Objective, ObjectiveOutput

#: Where the distillation parts appear (``metric/distill.kl``, ``metric/distill.hard``).
DISTILL_PREFIX = "distill"


def distillation_kl(
    student: Tensor, teacher: Tensor, targets: Tensor, temperature: float
) -> Tensor:
    """Mean over positions whose target is not -100 of KL(softmax(teacher/T) ‖
    softmax(student/T)), in fp32. ``student`` and ``teacher`` are (…, V) logits."""
    keep = targets.reshape(-1) != -100
    # The ids both predict: a padded vocabulary's extra rows (either side) are no tokens.
    v = min(student.shape[-1], teacher.shape[-1])
    s = student.reshape(-1, student.shape[-1])[keep, :v].float() / temperature
    t = teacher.reshape(-1, teacher.shape[-1])[keep, :v].float() / temperature
    per_token = F.kl_div(
        F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1), log_target=True, reduction="none"
    ).sum(-1)
    return per_token.sum() / keep.sum().clamp(min=1)


class Distillation(Objective):
    """The run's objective (``base``) mixed with the KL to a frozen ``teacher``."""

    def __init__(
        self, base: Objective, teacher: nn.Module, *, temperature: float, alpha: float
    ) -> None:
        super().__init__(base.loss, document_eos=base.document_eos)
        self.base = base
        self.teacher = teacher.eval().requires_grad_(False)
        self.temperature = temperature
        self.alpha = alpha

    @property
    def is_cross_entropy(self) -> bool:
        return False

    def to(self, device: torch.device | str) -> Distillation:
        self.base.to(device)
        self.teacher.to(device)
        return self

    def __call__(
        self,
        forward: Callable[..., Any],
        x: Tensor,
        y: Tensor,
        *,
        cross_entropy: bool = False,
    ) -> ObjectiveOutput:
        hard = self.base(forward, x, y, cross_entropy=True)
        if hard.logits is None:
            raise LlmkitError("train.distill: the model returned no logits")
        if self.teacher.training:  # something switched every module to training mode
            self.teacher.eval()
        with torch.no_grad():
            teacher_logits = self.teacher(x, **self.model_inputs(x)).logits
        kl = distillation_kl(hard.logits, teacher_logits, y, self.temperature)
        t2 = self.temperature**2
        loss = self.alpha * t2 * kl + (1 - self.alpha) * hard.loss
        metrics = dict(hard.metrics)
        metrics[f"{DISTILL_PREFIX}.kl"] = kl.detach()
        metrics[f"{DISTILL_PREFIX}.hard"] = hard.loss.detach()
        return ObjectiveOutput(loss, hard.aux_losses, metrics, hard.cross_entropy, hard.logits)


def teacher_run(spec: Any) -> Any:
    """The teacher run ``train.distill`` names (opened, not loaded): a one-line error when
    it is no run."""
    from llmkit.runs import open_run

    try:
        return open_run(Path(spec.teacher).expanduser())
    except LlmkitError as exc:
        raise LlmkitError(f"train.distill.teacher: {exc}") from exc


def teacher_tokenizer(spec: Any) -> Path | None:
    """The teacher run's tokenizer file (None when it has none)."""
    path = teacher_run(spec).dir / "tokenizer.json"
    return path if path.is_file() else None


def load_teacher(
    spec: Any, student_tokenizer: Any, device: torch.device, block_size: int | None = None
) -> nn.Module:
    """The frozen teacher model, after checking that it shares the student's tokenizer
    (both models then cover its ids; padding rows beyond them may differ) and reads blocks
    of ``block_size`` tokens."""
    from llmkit.runs import load_run

    run = teacher_run(spec)
    loaded = load_run(run.checkpoint or run.dir, which=spec.weights, device=str(device))
    ours, theirs = student_tokenizer.tok.get_vocab(), loaded.tokenizer.tok.get_vocab()
    if ours != theirs:
        only = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:1]
        example = f", e.g. {only[0][0]!r} -> {only[0][1]}" if only else ""
        raise LlmkitError(
            f"train.distill.teacher: {run.dir} uses another tokenizer ({len(theirs)} tokens "
            f"against the student's {len(ours)}{example}); teacher and student must share "
            "one (leave tokenizer.path unset to use the teacher's)"
        )
    context = loaded.model.config.max_seq_len
    if block_size is not None and context < block_size:
        raise LlmkitError(
            f"train.distill.teacher: {run.dir} reads at most {context} tokens, the student's "
            f"blocks hold {block_size}; set data.block_size to {context} or less"
        )
    return loaded.model
