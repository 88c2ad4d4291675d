"""The ``ffn`` kind, and the position-wise (B, T, C) → (B, T, C) properties that norms share."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from llmkit.testing.common import (
    Options,
    Record,
    _build_module,
    _capabilities,
    _check_grads,
    _check_input_grad,
    _check_side_outputs,
    _close,
    _device,
    _dtypes,
    _expect,
    _maxdiff,
    _randn,
    _run,
    small_context,
)


def _check_pointwise(record: Record, options: Options, device: str | torch.device | None) -> None:
    dev = _device(record, device)
    caps = _capabilities(record)
    module = _build_module(record, options, small_context(), dev).eval()
    B, T, C = 2, 6, 32
    gen = torch.Generator().manual_seed(99)
    x = _randn(gen, B, T, C, device=dev)

    def call(inp: Tensor, what: str, mod: nn.Module = module) -> Tensor:
        before = inp.detach().clone()
        desc = f"calling it ({what}; x {tuple(inp.shape)} {inp.dtype})"
        y = _run(record, desc, mod, inp)
        _expect(isinstance(y, Tensor), record, f"{desc} returned {type(y).__name__}")
        _expect(y.shape == inp.shape, record, f"{desc} returned shape {tuple(y.shape)}")
        _expect(y.dtype == inp.dtype, record, f"{desc} returned dtype {y.dtype}")
        _expect(bool(torch.isfinite(y).all()), record, f"{desc} returned non-finite values")
        _expect(torch.equal(inp.detach(), before), record, f"{desc} modified its input in place")
        _check_side_outputs(record, mod)
        return y

    with torch.no_grad():
        y = call(x, "float32")
        _expect(
            torch.equal(y, call(x, "again")),
            record,
            "two identical calls in eval mode gave different outputs (not deterministic)",
        )
        if caps.get("position_wise", True):
            for b in range(B):
                for t in range(T):
                    x2 = x.clone()
                    x2[b, t] = _randn(gen, C, device=dev)
                    y2 = call(x2, f"token ({b}, {t}) changed")
                    others = torch.ones(B, T, dtype=torch.bool, device=dev)
                    others[b, t] = False
                    _expect(
                        _close(y2[others], y[others], 1e-6, 1e-5),
                        record,
                        f"mixes positions: changing the input at (batch {b}, position {t}) "
                        f"changed other outputs (max diff {_maxdiff(y2[others], y[others]):.2e})",
                    )
                    _expect(
                        _maxdiff(y2[b, t], y[b, t]) > 0,
                        record,
                        f"the output at (batch {b}, position {t}) ignores its own input",
                    )
        for dtype in _dtypes(record):
            if dtype == torch.float32:
                continue
            low_mod = copy.deepcopy(module).to(dtype)
            low = call(x.to(dtype), str(dtype), low_mod)
            err, scale = _maxdiff(low, y), y.abs().max().item()
            _expect(
                err <= 0.05 * scale + 1e-2,
                record,
                f"{dtype} output differs from float32 by {err:.2e} (output scale {scale:.2e})",
            )

    module.train()
    xg = x.detach().clone().requires_grad_(True)
    weights = _randn(gen, B, T, C, device=dev)
    (call(xg, "backward") * weights).sum().backward()
    _check_input_grad(record, xg, "the input", "backward")
    _check_grads(record, module, "backward")
    module.eval()


def check_ffn(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """Check a feed-forward block: (B, T, C) → (B, T, C), position-wise, gradients,
    determinism, bfloat16."""
    _check_pointwise(record, options, device)
