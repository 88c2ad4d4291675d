"""Attention through ``torch.nn.functional.scaled_dot_product_attention``.

PyTorch dispatches to FlashAttention (Dao et al. 2022), memory-efficient attention
(Rabe & Staats 2021, xFormers) or its math backend. Plain causal attention without a bias or
padding takes the ``is_causal`` fast path (flash-eligible); anything else passes an explicit
bottom-right-aligned mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from llmkit.components.attention.dense import attention_mask, check_shapes
from llmkit.contracts import AttentionKernel, BuildContext, ComponentOptions, DistanceBias

#: ``enable_gqa`` exists from torch 2.5 on.
HAS_ENABLE_GQA: bool = torch.__version__ >= "2.5"


class SDPAttentionOptions(ComponentOptions):
    """Options of the SDPA kernel."""

    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on attention probabilities (training only)."
    )


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    """(B, Hkv, T, D) → (B, Hkv·groups, T, D), each kv head repeated for its query group."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    bias: DistanceBias | None = None,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Kernel-contract attention on top of ``F.scaled_dot_product_attention``."""
    groups = check_shapes(q, k, v)
    tq, tk = q.shape[2], k.shape[2]
    if bias is None and key_padding_mask is None and (not causal or tq == tk or tq == 1):
        # No explicit mask: flash-eligible. With Tq == Tk top-left and bottom-right causal
        # alignment coincide; a single query sees every key.
        kwargs = {}
        if groups > 1 and HAS_ENABLE_GQA:
            kwargs["enable_gqa"] = True
        elif groups > 1:
            k, v = _expand_kv(k, groups), _expand_kv(v, groups)
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal and tq > 1, **kwargs
        )

    mask, empty = attention_mask(
        tq, tk, causal=causal, key_padding_mask=key_padding_mask, device=q.device
    )
    attn_mask: Tensor | None = mask
    if bias is not None:
        dense_bias = bias.dense(tq, tk, causal=causal).to(device=q.device, dtype=q.dtype)[None]
        attn_mask = dense_bias if mask is None else dense_bias.masked_fill(~mask, float("-inf"))
    # With an explicit mask the memory-efficient backend is the fast one, and it does not take
    # ``enable_gqa``; expanding K/V (O(T·D)) is far cheaper than the math backend's O(T²).
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out


class SDPAttention(AttentionKernel):
    """PyTorch fused scaled dot-product attention (FlashAttention, Dao et al. 2022, and kin)."""

    Options = SDPAttentionOptions

    def __init__(self, options: SDPAttentionOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.dropout = options.dropout

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
        return sdpa_attention(
            q,
            k,
            v,
            causal=causal,
            bias=bias,
            key_padding_mask=key_padding_mask,
            dropout_p=self.dropout if self.training else 0.0,
        )
