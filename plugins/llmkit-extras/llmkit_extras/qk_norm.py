"""QK-norm attention: queries and keys are RMS-normalized per head before softmax attention.

Unbounded growth of attention logits makes softmax collapse to one-hot rows and training
diverge at high learning rates; normalizing q and k bounds every logit by √D. Dehghani et al.
2023 ("Scaling Vision Transformers to 22 Billion Parameters") introduced it with LayerNorm,
Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training
instabilities") showed it widens the range of stable learning rates, and OLMo 2 and Qwen3
use the RMSNorm form implemented here:

    q̂ = g_q · q / rms(q),   k̂ = g_k · k / rms(k)   (rms over the head dimension D)
    out = softmax(q̂ k̂ᵀ / √D + bias) v

The softmax itself runs through llmkit's SDPA kernel, so GQA, bottom-right alignment (KV
cache), score biases and key padding behave exactly as in the built-in ``sdpa``.

Where it sits: llmkit applies a q/k positional scheme (rotary) *before* the kernel. The RMS
over D is invariant under rotations, so the normalization commutes with RoPE; a learned gain
per dimension (``gain = "vector"``) does not, and with a q/k scheme it makes scores depend
slightly on absolute position. The default, one learned scalar for q and one for k
(``gain = "scalar"``), keeps scores exactly relative.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from llmkit.components.attention.sdpa import sdpa_attention
from llmkit.contracts import AttentionKernel, BuildContext, ComponentOptions, DistanceBias


class QKNormOptions(ComponentOptions):
    """Options of QK-norm attention."""

    gain: Literal["scalar", "vector", "none"] = Field(
        "scalar",
        description="Learned gain after normalizing: scalar (one for q, one for k; exact with "
        "rotary), vector (one per head dimension, as OLMo 2; not exactly relative with "
        "rotary, which llmkit applies first) or none.",
    )
    eps: float = Field(1e-6, gt=0.0, description="Added to the mean square of q and k.")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on attention probabilities (training only)."
    )


def rms_normalize(x: Tensor, gain: Tensor | None, eps: float) -> Tensor:
    """``gain · x / sqrt(mean(x², -1) + eps)`` computed in float32, returned in x's dtype."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if gain is not None:
        y = y * gain.float()
    return y.to(x.dtype)


class QKNormAttention(AttentionKernel):
    """Softmax attention on RMS-normalized q and k (Dehghani et al. 2023; Wortsman et al. 2023).

    Gains start at 1, so at initialization this is SDPA on q/rms(q) and k/rms(k).
    """

    Options = QKNormOptions

    def __init__(self, options: QKNormOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.eps = options.eps
        self.dropout = options.dropout
        shape = {"scalar": (1,), "vector": (ctx.head_dim,)}.get(options.gain)
        self.q_gain = nn.Parameter(torch.ones(shape)) if shape else None
        self.k_gain = nn.Parameter(torch.ones(shape)) if shape else None

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = True,
        bias: DistanceBias | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        q = rms_normalize(q, self.q_gain, self.eps)  # (B, Hq, Tq, D)
        k = rms_normalize(k, self.k_gain, self.eps)  # (B, Hkv, Tk, D)
        return sdpa_attention(
            q,
            k,
            v,
            causal=causal,
            bias=bias,
            key_padding_mask=key_padding_mask,
            dropout_p=self.dropout if self.training else 0.0,
        )

    def extra_repr(self) -> str:
        return f"gain={self.options.gain}, eps={self.eps}"
