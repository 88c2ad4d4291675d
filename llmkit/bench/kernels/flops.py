"""Useful work per call: attention and feed-forward FLOPs, and the bytes a norm moves."""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit.bench.kernels.entries import pop_side_outputs

MODES = ("fwd", "fwd+bwd")

ATTENTION_FLOPS = (
    "forward 4·B·H·D·P, P = attended (query, key) pairs: N² non-causal, N²/2 causal, "
    "N·w − w²/2 with a window W (w = min(W, N)); backward 2.5× forward"
)
FFN_FLOPS = "matmul FLOPs counted by torch's FlopCounterMode in one forward; backward 2× forward"
NORM_BYTES = "bytes of activations: 2·T·C·itemsize forward, 5·T·C·itemsize forward+backward"


def mode_factor(mode: str, *, backward: float) -> float:
    """Work of ``mode`` in units of one forward, with a backward of ``backward`` forwards;
    an unknown mode raises ValueError."""
    if mode == "fwd":
        return 1.0
    if mode == "fwd+bwd":
        return 1.0 + backward
    raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")


def attention_pairs(seq_len: int, *, causal: bool = True, window: int | None = None) -> float:
    """Attended (query, key) pairs of self-attention over ``seq_len`` tokens (see the package
    docstring): N² non-causal, N²/2 causal, N·w − w²/2 with a window (w = min(W, N))."""
    n = float(seq_len)
    if not causal:
        return n * n
    if window is None:
        return n * n / 2
    w = float(min(window, seq_len))
    return n * w - w * w / 2


def attention_flops(
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    *,
    causal: bool = True,
    window: int | None = None,
    mode: str = "fwd",
) -> float:
    """FLOPs of one attention call: forward 4·B·H·D·pairs; backward 2.5× forward."""
    fwd = 4.0 * batch * heads * head_dim * attention_pairs(seq_len, causal=causal, window=window)
    return fwd * mode_factor(mode, backward=2.5)


def norm_bytes(tokens: int, features: int, itemsize: int, mode: str) -> float:
    """Activation bytes a norm reads and writes: 2·T·C·itemsize forward, 5× with backward."""
    per = tokens * features * itemsize
    return per * (2.0 if mode == "fwd" else 5.0)


def ffn_flops(module: torch.nn.Module, x: Tensor, mode: str) -> float:
    """Forward matmul FLOPs counted by ``FlopCounterMode`` (2·T·Σ 2-D weights if it sees
    none), times 3 with the backward."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        module(x)
    pop_side_outputs(module)
    fwd = float(counter.get_total_flops())
    if fwd <= 0:
        tokens = x.numel() // x.shape[-1]
        weights = sum(p.numel() for p in module.parameters() if p.dim() >= 2)
        fwd = 2.0 * tokens * weights
    return fwd * mode_factor(mode, backward=2.0)


def ffn_work(module: torch.nn.Module, x: Tensor, mode: str) -> tuple[float | None, float | None]:
    """(flops, bytes) of a feed-forward call: :func:`ffn_flops`, no byte count."""
    return ffn_flops(module, x, mode), None


def norm_work(module: torch.nn.Module, x: Tensor, mode: str) -> tuple[float | None, float | None]:
    """(flops, bytes) of a norm call: no FLOPs (memory bound), :func:`norm_bytes`."""
    return None, norm_bytes(x.numel() // x.shape[-1], x.shape[-1], x.element_size(), mode)
