"""Token cross-entropy: the negative log-likelihood of each target under softmax(logits),
averaged over non-ignored targets — what llmkit's model computes as ``out.loss``."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from llmkit_losses.base import Loss, flatten, masked_mean
from llmkit_losses.options import CrossEntropyOptions as Options


class CrossEntropy(Loss):
    """``mean(−log softmax(logits)[target])`` over non-ignored targets, in float32."""

    Options = Options

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        flat, tgt, keep = flatten(logits, targets, self.options.ignore_index)
        nll = F.cross_entropy(flat, tgt.masked_fill(~keep, 0), reduction="none")
        return masked_mean(nll, keep)
