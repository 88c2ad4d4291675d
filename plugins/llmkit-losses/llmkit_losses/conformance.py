"""The conformance check of the ``loss`` kind, plugged into llmkit's suite.

The kind declares it (``register_kinds(..., check="llmkit_losses.conformance:check_loss")``),
so ``llmkit.testing.check_component`` runs :func:`check_loss` for every ``loss`` component,
whoever provides it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

import torch
from torch import Tensor

from llmkit.testing import build_options


def _fail(record: Any, message: str) -> NoReturn:
    raise AssertionError(
        f"{record.kind} {record.name!r} (from {getattr(record, 'provider', '?')}): {message}"
    )


def _expect(condition: bool, record: Any, message: str) -> None:
    if not condition:
        _fail(record, message)


def check_loss(
    record: Any,
    options: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device | None = None,
) -> None:
    """Check a ``loss`` component against :class:`llmkit_losses.base.Loss`'s contract.

    It builds as ``Loss(options)``; ``forward(logits (..., V), targets (...))`` returns a finite
    0-dim float32 tensor, deterministic, without modifying its inputs; (B, T, V) and flat
    (N, V) inputs agree; it is a mean (duplicating the batch leaves it unchanged); targets equal
    to ``ignore_index`` are left out and their logits do not matter; all-ignored gives a finite
    value and zero gradient; raising the targets' logits lowers the value and
    lowering them raises it; gradients reach the logits of every kept position; bfloat16
    logits give (nearly) the float32 value.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    try:
        factory = record.load()
    except Exception as exc:
        _fail(record, f"its target failed to import: {type(exc).__name__}: {exc}")
    opts = build_options(record, options)
    try:
        loss_fn = factory(opts)
    except Exception as exc:
        _fail(record, f"building it with {opts!r} raised {type(exc).__name__}: {exc}")
    _expect(callable(loss_fn), record, f"building it returned {loss_fn!r}, not a callable")
    if isinstance(loss_fn, torch.nn.Module):
        loss_fn = loss_fn.to(dev).eval()
    ignore = getattr(opts, "ignore_index", -100)

    def call(logits: Tensor, targets: Tensor, what: str) -> Tensor:
        before = (logits.detach().clone(), targets.clone())
        desc = f"calling it ({what}; logits {tuple(logits.shape)} {logits.dtype})"
        try:
            out = loss_fn(logits, targets)
        except Exception as exc:
            _fail(record, f"{desc} raised {type(exc).__name__}: {exc}")
        if hasattr(loss_fn, "pop_side_outputs"):
            loss_fn.pop_side_outputs()
        _expect(isinstance(out, Tensor), record, f"{desc} returned {type(out).__name__}")
        _expect(out.dim() == 0, record, f"{desc} returned shape {tuple(out.shape)}, not a scalar")
        _expect(out.dtype == torch.float32, record, f"{desc} returned dtype {out.dtype}")
        _expect(bool(torch.isfinite(out)), record, f"{desc} returned {out.item()}")
        _expect(
            torch.equal(logits.detach(), before[0]) and torch.equal(targets, before[1]),
            record,
            f"{desc} modified its inputs in place",
        )
        return out

    B, T, V = 2, 6, 11
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(B, T, V, generator=gen).to(dev)
    targets = torch.randint(0, V, (B, T), generator=gen).to(dev)
    with torch.no_grad():
        base = call(logits, targets, "(B, T, V)")
        _expect(
            torch.equal(base, call(logits, targets, "again")),
            record,
            "two identical calls gave different values (not deterministic)",
        )
        flat = call(logits.reshape(-1, V), targets.reshape(-1), "flat (N, V)")
        _expect(
            torch.allclose(flat, base, atol=1e-6, rtol=1e-6),
            record,
            f"flat (N, V) inputs give {flat.item():.6f}, (B, T, V) give {base.item():.6f}",
        )
        doubled = call(torch.cat([logits, logits]), torch.cat([targets, targets]), "batch twice")
        _expect(
            torch.allclose(doubled, base, atol=1e-6, rtol=1e-6),
            record,
            f"the batch repeated twice gives {doubled.item():.6f} instead of {base.item():.6f}: "
            "a loss must be a mean over targets, not a sum",
        )

        masked = targets.clone()
        masked[0, :3] = ignore
        keep = masked != ignore
        got = call(logits, masked, f"targets partly = ignore_index {ignore}")
        want = call(logits[keep], targets[keep], "only the kept targets")
        _expect(
            torch.allclose(got, want, atol=1e-6, rtol=1e-6),
            record,
            f"with ignored targets the value is {got.item():.6f}, but the kept targets alone "
            f"give {want.item():.6f}: ignore_index must leave those positions out of the mean",
        )
        noisy = logits.clone()
        noisy[0, :3] = torch.randn(3, V, generator=gen).to(dev) * 10
        _expect(
            torch.allclose(call(noisy, masked, "ignored logits changed"), got, atol=1e-6),
            record,
            "changing the logits at ignored positions changed the value",
        )

        onehot = torch.nn.functional.one_hot(targets, V).float()
        good = call(logits + onehot, targets, "logits raised on the targets")
        bad = call(logits - onehot, targets, "logits lowered on the targets")
        _expect(
            good < base < bad,
            record,
            f"not a training objective: raising the targets' logits by 1 gives {good.item():.4f}, "
            f"random logits {base.item():.4f}, lowering them by 1 {bad.item():.4f} (must increase)",
        )
        low = call(logits.bfloat16(), targets, "bfloat16 logits")
        _expect(
            abs(low.item() - base.item()) <= 5e-2 * max(1.0, abs(base.item())),
            record,
            f"bfloat16 logits give {low.item():.4f}, float32 {base.item():.4f}",
        )

    lg = logits.detach().clone().requires_grad_(True)
    call(lg, masked, "backward").backward()
    _expect(lg.grad is not None, record, "no gradient reaches the logits")
    _expect(bool(torch.isfinite(lg.grad).all()), record, "the gradient of the logits is not finite")
    _expect(
        bool(lg.grad[keep].abs().sum(-1).gt(0).all()),
        record,
        "some kept position gets no gradient",
    )
    _expect(
        bool(lg.grad[~keep].eq(0).all()),
        record,
        "ignored positions receive a gradient",
    )
    lg = logits.detach().clone().requires_grad_(True)
    everything = torch.full_like(targets, ignore)
    none_kept = call(lg, everything, "every target ignored")
    none_kept.backward()
    _expect(
        lg.grad is None or bool(lg.grad.eq(0).all()),
        record,
        "with every target ignored the logits still receive a gradient",
    )
