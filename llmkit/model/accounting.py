"""What a model costs: parameters, FLOPs, KV-cache bytes and training memory.

Functions of a built :class:`~llmkit.model.Transformer`; the model's methods of the same
names delegate here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llmkit.model.transformer import Transformer

__all__ = [
    "active_params",
    "flops_per_token",
    "kv_cache_bytes_per_token",
    "num_params",
    "training_memory",
]


def embedding_params(model: Transformer) -> set[int]:
    """Ids of the token- and position-embedding parameters."""
    ids = {id(model.tok_emb.weight)}
    ids.update(id(p) for p in model.position.parameters())
    return ids


def num_params(model: Transformer, exclude_embeddings: bool = False) -> int:
    """Unique parameters; optionally without token and position embeddings."""
    skip = embedding_params(model) if exclude_embeddings else set()
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or id(p) in skip:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def active_params(model: Transformer) -> int:
    """Parameters used per token: components may report fewer (e.g. routed experts)
    through an ``active_parameters()`` method."""
    total = num_params(model)
    for mod in model.modules():
        fn = getattr(mod, "active_parameters", None)
        if mod is not model and callable(fn):
            total -= sum(p.numel() for p in mod.parameters()) - int(fn())
    return total


def flops_per_token(model: Transformer, seq_len: int | None = None) -> dict[str, float]:
    """Forward and training FLOPs per token (PaLM appendix B: 6N + 12·L·H·Q·T for
    training), counting active parameters and each layer's attention span."""
    m = model.config
    T = seq_len or m.max_seq_len
    emb = embedding_params(model)
    matmul = active_params(model) - sum(p.numel() for p in model.parameters() if id(p) in emb)
    if m.tie_embeddings:
        matmul += m.vocab_size * m.d_model  # the output head still multiplies
    attn = 0.0
    for module in model.attention_modules:
        window = module.kernel.cache_window
        span = min(T, window) if window else T
        attn += 4 * m.n_heads * m.dim_head * span
    forward = 2 * matmul + attn
    return {"forward": forward, "train": 3 * forward}


def kv_cache_bytes_per_token(model: Transformer, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K and V stored per token (sliding-window layers stop growing at W)."""
    size = torch.empty(0, dtype=dtype).element_size()
    m = model.config
    return len(model.attention_modules) * 2 * m.kv_heads * m.dim_head * size


def training_memory(
    model: Transformer,
    batch_size: int,
    seq_len: int | None = None,
    *,
    param_bytes: int = 4,
    activation_bytes: int = 2,
    optimizer_states: int = 2,
) -> dict[str, int]:
    """Estimated bytes a training step needs: weights, grads, optimizer state, and
    activations from Korthikanti et al. 2022 (sbh·(34 + 5as/h) per layer at 16-bit,
    without the 5as/h score term for fused kernels that never store the scores)."""
    m = model.config
    s = seq_len or m.max_seq_len
    n = num_params(model)
    b, h, a = batch_size, m.d_model, m.n_heads
    act = 0.0
    for plan in model.spec.layers:
        stores_scores = plan.attention.record.capabilities.get("materializes_scores", False)
        per = 34 + (5 * a * s / h if stores_scores else 0)
        act += s * b * h * per * activation_bytes / 2
    logits = b * s * m.vocab_size * 4 * 2  # fp32 logits and their gradient
    out = {
        "weights": n * param_bytes,
        "gradients": n * param_bytes,
        "optimizer": n * 4 * optimizer_states,
        "activations": int(act) + logits,
    }
    out["total"] = sum(out.values())
    return out
