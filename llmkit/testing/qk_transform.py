"""The ``qk_transform`` kind: ``QKTransform(options, ctx)``; ``forward(q, k) -> (q, k)`` on
(B, Hq, T, D) and (B, Hkv, T, D), applied by the attention module before positions and the
kernel (see :mod:`llmkit.contracts`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmkit.testing.block import model_registry
from llmkit.testing.combinations import check_model_combination
from llmkit.testing.common import (
    Options,
    Record,
    _build_module,
    _check_grads,
    _check_input_grad,
    _close,
    _device,
    _dtypes,
    _expect,
    _maxdiff,
    _randn,
    _run,
    small_context,
)

#: Tiny models the transform is checked in: (attention, position) pairs.
MODELS = [("sdpa", "rope"), ({"name": "sliding_window", "window": 4}, "rope")]


def _build(record: Record, options: Options, dev: torch.device, dtype: torch.dtype) -> nn.Module:
    return _build_module(record, options, small_context(), dev).to(dtype=dtype)


def _call(
    record: Record, module: nn.Module, q: Tensor, k: Tensor, what: str
) -> tuple[Tensor, Tensor]:
    out = _run(record, what, module, q, k)
    _expect(
        isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, Tensor) for t in out),
        record,
        f"{what} must return a (q, k) pair of tensors, got {type(out).__name__}",
    )
    for got, given, name in ((out[0], q, "q"), (out[1], k, "k")):
        _expect(got.shape == given.shape, record, f"{what}: {name} {tuple(got.shape)} != input")
        _expect(got.dtype == given.dtype, record, f"{what}: {name} dtype {got.dtype} != input")
        _expect(bool(torch.isfinite(got).all()), record, f"{what}: {name} is not finite")
    return out


def check_qk_transform(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """Check a q/k transform: a (q, k) pair of the input shapes and dtype with GQA (4 query,
    2 key heads); position-wise (a prefix or one token alone gives the same rows: keys are
    cached after it) and batch rows independent; gradients to q, k and every parameter;
    deterministic; bfloat16; then tiny models using it (sdpa and sliding_window, with rope):
    training, causality and KV-cache decoding equal to the full forward."""
    dev = _device(record, device)
    ctx = small_context()
    B, T, D = 2, 10, ctx.head_dim
    gen = torch.Generator().manual_seed(0)
    module = _build(record, options, dev, torch.float32)
    q = _randn(gen, B, ctx.n_heads, T, D, device=dev, scale=3.0).requires_grad_(True)
    k = _randn(gen, B, ctx.n_kv_heads, T, D, device=dev, scale=3.0).requires_grad_(True)
    q2, k2 = _call(record, module, q, k, "forward")
    w = _randn(gen, *q2.shape, device=dev), _randn(gen, *k2.shape, device=dev)
    ((q2 * w[0]).sum() + (k2 * w[1]).sum()).backward()
    _check_grads(record, module, "backward")
    _check_input_grad(record, q, "q", "backward")
    _check_input_grad(record, k, "k", "backward")

    module.eval()
    with torch.no_grad():
        q, k = q.detach(), k.detach()
        full = _call(record, module, q, k, "forward")
        again = _call(record, module, q, k, "a second forward")
        _expect(all(map(torch.equal, full, again)), record, "not deterministic")
        for a, b in ((0, T // 2), (T // 2, T // 2 + 1)):
            part = _call(record, module, q[:, :, a:b], k[:, :, a:b], f"forward on tokens {a}..")
            for got, whole, name in zip(part, full, "qk", strict=True):
                _expect(
                    _close(got, whole[:, :, a:b], 1e-5, 1e-5),
                    record,
                    f"not position-wise: {name} of tokens {a}..{b - 1} alone differs from the "
                    f"full call by {_maxdiff(got, whole[:, :, a:b]):.2e}",
                )
        row = _call(record, module, q[1:], k[1:], "forward on one batch row")
        _expect(
            all(_close(r, f[1:], 1e-5, 1e-5) for r, f in zip(row, full, strict=True)),
            record,
            "batch rows are not independent",
        )
    for dtype in _dtypes(record):
        if dtype != torch.float32:
            low = _build(record, options, dev, dtype)
            _call(record, low, q.to(dtype), k.to(dtype), f"forward in {dtype}")
    ref = {"name": record.name, **dict(options or {})}
    for attention, position in MODELS:
        _run(
            record,
            f"a tiny model with attention {attention}, position {position}",
            check_model_combination,
            attention,
            position,
            "mlp",
            "layernorm",
            model={"qk_transform": ref},
            registry=model_registry(record),
            device=dev,
        )
