"""Cross-entropy with PaLM's z-loss (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling
with Pathways", §5): ``weight · log²Z`` with ``Z = Σ exp(logits)`` the softmax normalizer,
added to the cross-entropy. It keeps log Z near 0, which the paper found increases the
stability of training; PaLM uses weight 1e-4.

Reports two metrics through llmkit's ``SideOutputs``: ``cross_entropy`` and ``z_loss`` (the
weighted term), so a training loop can log both parts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit_losses.base import Loss, flatten, masked_mean
from llmkit_losses.options import ZLossOptions as Options


class ZLoss(Loss):
    """``mean(nll + weight · (log Z)²)`` over non-ignored targets (Chowdhery et al. 2022)."""

    Options = Options

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        flat, tgt, keep = flatten(logits, targets, self.options.ignore_index)
        log_z = torch.logsumexp(flat, dim=-1)  # (N,)
        nll = log_z - flat.gather(-1, tgt.masked_fill(~keep, 0)[:, None])[:, 0]
        ce = masked_mean(nll, keep)
        z = self.options.weight * masked_mean(log_z.square(), keep)
        self.report_metric("cross_entropy", ce.detach())
        self.report_metric("z_loss", z.detach())
        return ce + z
