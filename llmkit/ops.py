"""Small attention ops that components, kernels and plugins share (the contract layer).

- :func:`check_shapes` validates the :class:`~llmkit.contracts.AttentionKernel` shapes.
- :func:`attention_mask` builds the boolean mask of that contract: bottom-right causal
  alignment, an optional causal window, key padding, documents (``document_ids``: a query
  sees only keys of its own document) and the rows left with no key.
- :func:`check_document_ids` and :func:`document_bounds` validate document ids and give each
  token's document span, for kernels that skip whole documents.
- :func:`reference_attention` is *the* reference: ``softmax(q kᵀ / √d + bias) v`` in plain
  PyTorch and fp32 (Vaswani et al. 2017), with grouped-query attention (Ainslie et al. 2023).
  The ``dense`` component runs it, and every other kernel is tested against it.
- :func:`sdpa_attention` runs the same contract through
  ``torch.nn.functional.scaled_dot_product_attention``.

This module imports only torch and :mod:`llmkit.contracts`; plugins reach it through
``from llmkit import ...``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from llmkit.contracts import DistanceBias

__all__ = [
    "HAS_ENABLE_GQA",
    "attention_mask",
    "check_document_ids",
    "check_shapes",
    "document_bounds",
    "expand_kv",
    "reference_attention",
    "sdpa_attention",
    "sdpa_mask",
]

#: ``enable_gqa`` exists from torch 2.5 on.
HAS_ENABLE_GQA: bool = torch.__version__ >= "2.5"


def check_shapes(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Validate the kernel contract's shapes; return the GQA group size Hq // Hkv."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects 4-D (B, H, T, D) tensors, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, hq, tq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)}"
        )
    hkv, tk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if tk < tq:
        raise ValueError(f"fewer keys ({tk}) than queries ({tq})")
    return hq // hkv


def check_document_ids(document_ids: Tensor, b: int, tk: int) -> Tensor:
    """Validate ``document_ids`` of the kernel contract: an integer (B, Tk) tensor (one id per
    key; queries take the last Tq). Returns it."""
    if document_ids.dim() != 2 or tuple(document_ids.shape) != (b, tk):
        raise ValueError(
            f"document_ids must be (B, Tk) = {(b, tk)}, got {tuple(document_ids.shape)}"
        )
    if document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
        raise ValueError(f"document_ids must be an integer tensor, got {document_ids.dtype}")
    return document_ids


def document_bounds(document_ids: Tensor) -> tuple[Tensor, Tensor]:
    """For (..., T) document ids (a document is a run of equal ids), the index of the first
    token of each token's document and one past its last, both (..., T) int64."""
    t = document_ids.shape[-1]
    idx = torch.arange(t, device=document_ids.device).expand_as(document_ids)
    change = document_ids[..., 1:] != document_ids[..., :-1]  # (..., T−1): a new run at i+1
    first = torch.ones_like(document_ids, dtype=torch.bool)
    first[..., 1:] = change
    last = torch.ones_like(document_ids, dtype=torch.bool)
    last[..., :-1] = change
    starts = torch.where(first, idx, 0).cummax(-1).values
    ends = torch.where(last, idx + 1, t).flip(-1).cummin(-1).values.flip(-1)
    return starts, ends


def attention_mask(
    tq: int,
    tk: int,
    *,
    causal: bool,
    key_padding_mask: Tensor | None,
    device: torch.device,
    window: int | None = None,
    document_ids: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Boolean mask (B or 1, 1, Tq, Tk), True = may attend, and the rows that attend to nothing.

    Queries are aligned to the last ``tq`` of ``tk`` keys (query i sits at key position
    ``tk - tq + i``). ``window`` W (causal only, ignored otherwise) keeps the keys at positions
    p − W + 1 … p of a query at p. ``document_ids`` (B, Tk) keeps only keys with the query's
    own id. Rows left with no key at all (a query on left padding) are
    re-opened to every key so that softmax stays finite; the second result, (B or 1, 1, Tq, 1)
    True where a row is empty, tells the caller to zero those outputs. Returns
    ``(None, None)`` when nothing is masked.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be ≥ 1, got {window}")
    mask: Tensor | None = None
    window = window if causal else None
    if causal and (tq > 1 or window is not None):  # one query sits on the last key: sees all
        qpos = torch.arange(tk - tq, tk, device=device)[:, None]
        kpos = torch.arange(tk, device=device)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        mask = allowed[None, None]
    if document_ids is not None:
        docs = document_ids.to(device)
        same = (docs[:, -tq:, None] == docs[:, None, :])[:, None]  # (B, 1, Tq, Tk)
        mask = same if mask is None else mask & same
    if key_padding_mask is not None:
        pad = key_padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
        mask = pad if mask is None else mask & pad
    if mask is None:
        return None, None
    empty = ~mask.any(dim=-1, keepdim=True)
    if key_padding_mask is None:  # a query always keeps its own key (same document too)
        return mask, None
    return mask | empty, empty


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    bias: DistanceBias | None = None,
    key_padding_mask: Tensor | None = None,
    window: int | None = None,
    dropout_p: float = 0.0,
    softcap: float | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """The attention kernel contract in plain PyTorch; scores, softmax and the sum in fp32.

    q (B, Hq, Tq, D); k, v (B, Hkv, Tk, D); query i sits at key position Tk − Tq + i. Heads
    are grouped without copying K/V: query head ``h`` reads key/value head ``h // (Hq // Hkv)``
    (the ``repeat_interleave`` convention of SDPA's ``enable_gqa``). ``bias`` adds
    ``bias.dense(Tq, Tk)``; ``key_padding_mask`` (B, Tk) is True where a key may be attended;
    ``window`` W (causal only) keeps keys at positions p − W + 1 … p; ``document_ids`` (B, Tk)
    keeps only keys of the query's own document. A query left with no key returns zeros.
    ``dropout_p`` drops attention probabilities (callers pass 0 in eval).
    ``softcap`` c maps the scaled scores to c·tanh(s/c) before the bias and the masks
    (Gemma 2's attention logit soft-capping).
    """
    groups = check_shapes(q, k, v)
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if document_ids is not None:
        check_document_ids(document_ids, b, tk)
    qf = q.float().reshape(b, hkv, groups * tq, d)
    scores = torch.matmul(qf, k.float().transpose(-1, -2)) * (1.0 / math.sqrt(d))
    scores = scores.view(b, hkv, groups, tq, tk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.dense(tq, tk, causal=causal).to(scores.device).view(
            hkv, groups, tq, tk
        )
    mask, empty = attention_mask(
        tq,
        tk,
        causal=causal,
        key_padding_mask=key_padding_mask,
        device=q.device,
        window=window,
        document_ids=document_ids,
    )
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if empty is not None:
        probs = probs.masked_fill(empty[:, :, None], 0.0)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    out = torch.matmul(probs.view(b, hkv, groups * tq, tk), v.float())
    return out.view(b, hq, tq, d).to(q.dtype)


def expand_kv(x: Tensor, groups: int) -> Tensor:
    """(B, Hkv, T, D) → (B, Hkv·groups, T, D), each kv head repeated for its query group."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def sdpa_mask(
    q: Tensor,
    tk: int,
    *,
    causal: bool,
    bias: DistanceBias | None,
    key_padding_mask: Tensor | None,
    window: int | None = None,
    document_ids: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """The ``attn_mask`` of an SDPA call for queries ``q`` over ``tk`` keys: the boolean
    :func:`attention_mask`, or with a distance bias that bias (1, H, Tq, Tk) in q's dtype with
    −inf where the mask says no; and the empty rows (see :func:`attention_mask`)."""
    tq = q.shape[2]
    mask, empty = attention_mask(
        tq,
        tk,
        causal=causal,
        key_padding_mask=key_padding_mask,
        device=q.device,
        window=window,
        document_ids=document_ids,
    )
    if bias is None:
        return mask, empty
    dense_bias = bias.dense(tq, tk, causal=causal).to(device=q.device, dtype=q.dtype)[None]
    return (dense_bias if mask is None else dense_bias.masked_fill(~mask, float("-inf"))), empty


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    bias: DistanceBias | None = None,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Kernel-contract attention on top of ``F.scaled_dot_product_attention``.

    Plain causal attention without a bias or padding takes the ``is_causal`` fast path
    (flash-eligible); anything else passes an explicit bottom-right-aligned mask. ``window``
    (causal only) and ``document_ids`` (B, Tk) are masks too: documents as one boolean
    block-diagonal causal mask, the fastest CPU form measured (forward and backward at
    B 8, H 4, L 256, D 32 on a 2-core EPYC: 1.11× the plain causal call in fp32, 1.05× in
    bf16; one call per document and row 1.6× and 2.3×; torch's flex_attention has no CPU
    backward; benchmarks/scripts/document_mask_cost.py).
    """
    groups = check_shapes(q, k, v)
    tq, tk = q.shape[2], k.shape[2]
    if document_ids is not None:
        check_document_ids(document_ids, q.shape[0], tk)
    plain = bias is None and key_padding_mask is None and document_ids is None
    if plain and (window is None or not causal) and (not causal or tq == tk or tq == 1):
        # No explicit mask: flash-eligible. With Tq == Tk top-left and bottom-right causal
        # alignment coincide; a single query sees every key.
        kwargs = {}
        if groups > 1 and HAS_ENABLE_GQA:
            kwargs["enable_gqa"] = True
        elif groups > 1:
            k, v = expand_kv(k, groups), expand_kv(v, groups)
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal and tq > 1, **kwargs
        )

    attn_mask, empty = sdpa_mask(
        q,
        tk,
        causal=causal,
        bias=bias,
        key_padding_mask=key_padding_mask,
        window=window,
        document_ids=document_ids,
    )
    # With an explicit mask the memory-efficient backend is the fast one, and it does not take
    # ``enable_gqa``; expanding K/V (O(T·D)) is far cheaper than the math backend's O(T²).
    k, v = expand_kv(k, groups), expand_kv(v, groups)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out
