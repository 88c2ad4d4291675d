"""QK-norm: queries and keys are RMS-normalized per head, before positions and attention.

Unbounded growth of attention logits makes softmax collapse to one-hot rows and training
diverge at high learning rates; normalizing q and k bounds every logit by √D·g_q·g_k.
Dehghani et al. 2023 ("Scaling Vision Transformers to 22 Billion Parameters") introduced it
with LayerNorm, Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer
training instabilities") showed it widens the range of stable learning rates, and OLMo 2,
Qwen3 and Gemma 3 use the RMSNorm form implemented here:

    q̂ = g_q ⊙ q / rms(q),   k̂ = g_k ⊙ k / rms(k)   (rms over the head dimension D)

It is a ``qk_transform``: llmkit's attention module applies it to the projected q and k
*before* a rotary scheme and before the attention kernel, as those models do. So a learned
gain per dimension stays exactly relative under RoPE, every kernel (``sdpa``, ``flash``,
``sliding_window``, a plugin's) runs on the normalized q and k, and the KV cache stores keys
already normalized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit import BuildContext, QKTransform
from llmkit_extras.options import QKNormOptions


def rms_normalize(x: Tensor, gain: Tensor | None, eps: float) -> Tensor:
    """``gain · x / sqrt(mean(x², -1) + eps)`` computed in float32, returned in x's dtype."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if gain is not None:
        y = y * gain.float()
    return y.to(x.dtype)


class QKNorm(QKTransform):
    """RMSNorm of q (B, Hq, T, D) and k (B, Hkv, T, D) over D (Dehghani et al. 2023;
    Wortsman et al. 2023). Gains start at 1; parameters ``q_gain`` and ``k_gain``, or one
    ``gain`` when shared."""

    Options = QKNormOptions

    def __init__(self, options: QKNormOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.eps = options.eps
        shape = {"scalar": (1,), "vector": (ctx.head_dim,)}.get(options.gain)
        self.gain = self.q_gain = self.k_gain = None
        if shape and options.shared:
            self.gain = nn.Parameter(torch.ones(shape))
        elif shape:
            self.q_gain = nn.Parameter(torch.ones(shape))
            self.k_gain = nn.Parameter(torch.ones(shape))

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        gq = self.gain if self.gain is not None else self.q_gain
        gk = self.gain if self.gain is not None else self.k_gain
        return rms_normalize(q, gq, self.eps), rms_normalize(k, gk, self.eps)

    def extra_repr(self) -> str:
        return f"gain={self.options.gain}, shared={self.options.shared}, eps={self.eps}"
