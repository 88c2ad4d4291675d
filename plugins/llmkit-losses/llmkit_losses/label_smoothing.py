"""Label smoothing (Szegedy et al. 2016, "Rethinking the Inception Architecture for Computer
Vision"): cross-entropy against the target distribution ``(1 − ε)·onehot + ε/V``, which
discourages over-confident logits. Equal to ``F.cross_entropy(..., label_smoothing=ε)``."""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit_losses.base import Loss, flatten, masked_mean
from llmkit_losses.options import LabelSmoothingOptions as Options


class LabelSmoothing(Loss):
    """``(1 − ε)·nll + ε·mean_v(−log p_v)`` averaged over non-ignored targets."""

    Options = Options

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        flat, tgt, keep = flatten(logits, targets, self.options.ignore_index)
        logp = torch.log_softmax(flat, dim=-1)
        nll = -logp.gather(-1, tgt.masked_fill(~keep, 0)[:, None])[:, 0]
        uniform = -logp.mean(dim=-1)
        eps = self.options.smoothing
        return masked_mean((1.0 - eps) * nll + eps * uniform, keep)
