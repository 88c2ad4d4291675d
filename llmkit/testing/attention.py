"""The ``attention`` kind: kernels against :class:`~llmkit.contracts.AttentionKernel` and
:func:`llmkit.ops.reference_attention`, the one reference every kernel matches."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from llmkit.contracts import POSITION_SITES, DistanceBias
from llmkit.ops import reference_attention
from llmkit.testing.attention_documents import check_document_grads, check_documents
from llmkit.testing.common import (
    Options,
    Record,
    _build_module,
    _capabilities,
    _check_grads,
    _check_input_grad,
    _close,
    _device,
    _dtypes,
    _expect,
    _fail,
    _maxdiff,
    _randn,
    _run,
    _tolerance,
    small_context,
)

_SLOPES = (0.5, 0.25, 0.125, 0.0625)


class _Kernel:
    """Calls an attention kernel, checking what every call must satisfy."""

    def __init__(self, record: Record, module: nn.Module) -> None:
        self.record, self.module = record, module

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, what: str = "", **kw: Any) -> Tensor:
        record = self.record
        desc = f"calling it ({what or 'plain causal call'}; q {tuple(q.shape)}, k {tuple(k.shape)})"
        before = [t.detach().clone() for t in (q, k, v)]
        out = _run(record, desc, self.module, q, k, v, **kw)
        _expect(isinstance(out, Tensor), record, f"{desc} returned {type(out).__name__}")
        _expect(
            out.shape == q.shape,
            record,
            f"{desc} returned shape {tuple(out.shape)}, expected (B, Hq, Tq, D) = {tuple(q.shape)}",
        )
        _expect(
            out.dtype == q.dtype, record, f"{desc} returned dtype {out.dtype}, expected {q.dtype}"
        )
        _expect(bool(torch.isfinite(out).all()), record, f"{desc} returned non-finite values")
        for name, t, b in zip("qkv", (q, k, v), before):
            _expect(torch.equal(t.detach(), b), record, f"{desc} modified {name} in place")
        return out


def _kernel_inputs(
    gen: torch.Generator, b: int, hq: int, hkv: int, t: int, d: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        _randn(gen, b, hq, t, d, device=device),
        _randn(gen, b, hkv, t, d, device=device),
        _randn(gen, b, hkv, t, d, device=device),
    )


def check_attention(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """Check an attention kernel against the :class:`~llmkit.contracts.AttentionKernel`
    contract (see the module docstring for the list)."""
    dev = _device(record, device)
    caps = _capabilities(record)
    gqa = caps.get("gqa", True)
    exact = not caps.get("approximate", False)
    sites = set(caps.get("positions", POSITION_SITES))
    tol = _tolerance(dev)
    B, H, D, T = 2, 4, 8, 12
    hkv = 2 if gqa else H
    module = _build_module(record, options, small_context(n_kv_heads=hkv), dev).eval()
    _expect(
        hasattr(module, "cache_window"),
        record,
        "has no cache_window attribute (subclass llmkit.contracts.AttentionKernel)",
    )
    window = module.cache_window
    _expect(
        window is None or (isinstance(window, int) and window >= 1),
        record,
        f"cache_window must be None or a positive int, got {window!r}",
    )
    kernel = _Kernel(record, module)
    gen = torch.Generator().manual_seed(1234)
    q, k, v = _kernel_inputs(gen, B, H, hkv, T, D, dev)

    with torch.no_grad():
        out = kernel(q, k, v)
        _expect(
            torch.equal(out, kernel(q, k, v)),
            record,
            "two identical calls in eval mode gave different outputs (not deterministic)",
        )
        if exact:
            ref = reference_attention(q, k, v, window=window)
            _expect(
                _close(out, ref, tol, tol),
                record,
                f"differs from reference_attention (causal, window {window}) by "
                f"{_maxdiff(out, ref):.2e}; set capability approximate=True if this is by design",
            )
        _attention_causality(record, kernel, q, k, v, out, gen, dev)
        _attention_alignment(record, kernel, q, k, v, out)
        if window is not None:
            _attention_window(record, kernel, window, exact, tol, sites, gen, dev, H, hkv, D)
        _attention_gqa(record, options, gqa, exact, tol, sites, dev, q, gen)
        if "score_bias" in sites:
            _attention_bias(record, kernel, q, k, v, out, window, exact, tol, gen, dev)
        _attention_padding(record, kernel, q, k, v, out, window, exact, tol, sites, gen, dev)
        _attention_noncausal(record, kernel, q, k, v, caps, exact, tol, gen, dev)
        if getattr(module, "supports_document_mask", False):
            check_documents(record, kernel, q, k, v, out, window, exact, tol, caps, sites)
        for dtype in _dtypes(record):
            if dtype == torch.float32:
                continue
            low = kernel(q.to(dtype), k.to(dtype), v.to(dtype), what=f"{dtype} inputs")
            _expect(
                _maxdiff(low, out) <= 5e-2,
                record,
                f"{dtype} output differs from the float32 output by {_maxdiff(low, out):.2e}",
            )

    # Gradients (train mode) reach q, k, v and every parameter.
    module.train()
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    weights = _randn(gen, *q.shape, device=dev)
    (kernel(qg, kg, vg, what="backward") * weights).sum().backward()
    for name, t in zip("qkv", (qg, kg, vg)):
        if name == "v" or window != 1:  # with a window of 1 the output is v itself
            _check_input_grad(record, t, name, "backward through the kernel")
    _check_grads(record, module, "backward through the kernel")
    module.eval()
    _attention_backward(record, kernel, q, k, v, window, exact, tol, caps, sites, gen, dev)
    if getattr(module, "supports_document_mask", False):
        check_document_grads(record, kernel, q, k, v, gen, dev)


def _grads(kernel: _Kernel, q, k, v, weights, rows: slice | None = None, **kw: Any):
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = kernel(qg, kg, vg, what=f"backward{' ' + str(kw) if kw else ''}", **kw)
    if rows is not None:
        out, weights = out[:, :, rows], weights[:, :, rows]
    (out * weights).sum().backward()
    return qg.grad, kg.grad, vg.grad


def _attention_backward(record, kernel, q, k, v, window, exact, tol, caps, sites, gen, dev):
    """Gradients match the reference's, are causal, and are deterministic (on CPU)."""
    T = q.shape[2]
    weights = _randn(gen, *q.shape, device=dev)
    calls: list[dict[str, Any]] = [{}]
    if not caps.get("causal_only"):
        calls.append({"causal": False})
    if "score_bias" in sites:
        calls.append({"bias": DistanceBias(torch.tensor(_SLOPES, device=dev))})
    for kw in calls:
        tag = f" ({kw})" if kw else ""
        got = _grads(kernel, q, k, v, weights, **kw)
        if exact:
            qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            w = window if kw.get("causal", True) else None
            (reference_attention(qr, kr, vr, window=w, **kw) * weights).sum().backward()
            for name, a, b in zip("qkv", got, (qr.grad, kr.grad, vr.grad)):
                _expect(
                    _close(a, b, 5 * tol, 5 * tol),
                    record,
                    f"the gradient of {name}{tag} differs from reference_attention's by "
                    f"{_maxdiff(a, b):.2e}",
                )
        if dev.type == "cpu":
            again = _grads(kernel, q, k, v, weights, **kw)
            for name, a, b in zip("qkv", got, again):
                _expect(
                    torch.equal(a, b),
                    record,
                    f"two identical backward passes{tag} gave different gradients of {name}",
                )
    s = T // 2
    for kw in calls:
        if kw.get("causal") is False:
            continue
        _, gk, gv = _grads(kernel, q, k, v, weights, rows=slice(0, s + 1), **kw)
        leak = max(gk[:, :, s + 1 :].abs().max().item(), gv[:, :, s + 1 :].abs().max().item())
        _expect(
            leak <= 1e-7,
            record,
            f"backward is not causal{f' ({kw})' if kw else ''}: outputs at positions ≤ {s} "
            f"send gradient {leak:.2e} to keys/values after {s}",
        )


def _split_points(t: int) -> list[int]:
    return sorted({p for p in (0, 1, t // 3, t // 2, t - 3, t - 2) if 0 <= p < t - 1})


def _attention_causality(record, kernel, q, k, v, out, gen, dev) -> None:
    T = q.shape[2]
    for s in _split_points(T):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for t in (q2, k2, v2):
            t[:, :, s + 1 :] = _randn(gen, *t[:, :, s + 1 :].shape, device=dev, scale=10.0)
        out2 = kernel(q2, k2, v2, what=f"causality, future of position {s} changed")
        _expect(
            _close(out2[:, :, : s + 1], out[:, :, : s + 1], 1e-6),
            record,
            f"not causal: changing queries/keys/values after position {s} changed outputs at "
            f"positions ≤ {s} (max diff {_maxdiff(out2[:, :, : s + 1], out[:, :, : s + 1]):.2e})",
        )
        v3 = v.clone()
        v3[:, :, s] += 5.0
        out3 = kernel(q, k, v3, what=f"value at position {s} changed")
        _expect(
            _maxdiff(out3[:, :, s], out[:, :, s]) > 1e-3,
            record,
            f"the output at position {s} ignores the value at position {s}: "
            "a causal query must attend its own key",
        )


def _attention_alignment(record, kernel, q, k, v, out) -> None:
    T = q.shape[2]
    for tq in (1, 3):
        part = kernel(q[:, :, -tq:], k, v, what=f"last {tq} queries over all {T} keys")
        _expect(
            _close(part, out[:, :, -tq:], 1e-5, 1e-5),
            record,
            f"the last {tq} queries against all {T} keys differ from the last {tq} rows of the "
            f"full causal output by {_maxdiff(part, out[:, :, -tq:]):.2e}: queries must be "
            "aligned bottom-right (query i at key position Tk − Tq + i), as a KV cache needs",
        )
    s, tq = T // 2, 2
    part = kernel(
        q[:, :, s - tq + 1 : s + 1],
        k[:, :, : s + 1],
        v[:, :, : s + 1],
        what=f"{tq} queries over a {s + 1}-key prefix",
    )
    want = out[:, :, s - tq + 1 : s + 1]
    _expect(
        _close(part, want, 1e-5, 1e-5),
        record,
        f"queries {s - tq + 1}..{s} against keys 0..{s} differ from the same rows of the full "
        f"output by {_maxdiff(part, want):.2e} (bottom-right alignment over a cache prefix)",
    )


def _attention_window(record, kernel, window, exact, tol, sites, gen, dev, H, hkv, D) -> None:
    """A kernel declaring ``cache_window`` W may only read the last W keys of each query."""
    tw = window + 5
    if tw > 1024:
        return
    q, k, v = _kernel_inputs(gen, 1, H, hkv, tw, D, dev)
    out = kernel(q, k, v, what=f"sequence of {tw} with cache_window {window}")
    if exact:
        ref = reference_attention(q, k, v, window=window)
        _expect(
            _close(out, ref, tol, tol),
            record,
            f"differs from reference_attention with window {window} (its cache_window) by "
            f"{_maxdiff(out, ref):.2e}",
        )
    t = tw - 1
    k2, v2 = k.clone(), v.clone()
    old = slice(0, t - window + 1)
    k2[:, :, old] = _randn(gen, *k2[:, :, old].shape, device=dev, scale=10.0)
    v2[:, :, old] = _randn(gen, *v2[:, :, old].shape, device=dev, scale=10.0)
    out2 = kernel(q, k2, v2, what="keys older than the window changed")
    _expect(
        _close(out2[:, :, t], out[:, :, t], 1e-6),
        record,
        f"cache_window is {window}, but the output at position {t} changed when keys at "
        f"positions < {t - window + 1} changed: a KV cache keeping {window} keys would be wrong",
    )
    calls: list[dict[str, Any]] = [{}]
    if "score_bias" in sites:
        calls.append({"bias": DistanceBias(torch.tensor(_SLOPES, device=dev))})
    for kw in calls:
        full = out if not kw else kernel(q, k, v, what="windowed, with a bias", **kw)
        tag = " with a bias" if kw else ""
        for tq in (1, 2):
            n = window + tq - 1
            part = kernel(
                q[:, :, -tq:], k[:, :, -n:], v[:, :, -n:], what=f"cache view of {n} keys{tag}", **kw
            )
            _expect(
                _close(part, full[:, :, -tq:], 1e-5, 1e-5),
                record,
                f"the last {tq} queries over only the last {n} keys{tag} (what a KV cache of "
                f"cache_window {window} holds) differ from the full output by "
                f"{_maxdiff(part, full[:, :, -tq:]):.2e}",
            )


def _attention_gqa(record, options, gqa, exact, tol, sites, dev, q, gen) -> None:
    if not gqa:
        return
    B, H, T, D = q.shape
    mha = _Kernel(record, _build_module(record, options, small_context(n_kv_heads=H), dev).eval())
    for hkv in (H, H // 2, 1):
        groups = H // hkv
        kern = _Kernel(
            record, _build_module(record, options, small_context(n_kv_heads=hkv), dev).eval()
        )
        k = _randn(gen, B, hkv, T, D, device=dev)
        v = _randn(gen, B, hkv, T, D, device=dev)
        calls = [{}]
        if "score_bias" in sites:
            calls.append({"bias": DistanceBias(torch.tensor(_SLOPES, device=dev))})
        for kw in calls:
            what = f"Hq/Hkv = {H}/{hkv}{' with a bias' if kw else ''}"
            out = kern(q, k, v, what=what, **kw)
            ref = mha(
                q,
                k.repeat_interleave(groups, 1),
                v.repeat_interleave(groups, 1),
                what=f"{what}, kv heads repeated",
                **kw,
            )
            _expect(
                _close(out, ref, 1e-5, 1e-5),
                record,
                f"{what}: differs by {_maxdiff(out, ref):.2e} from the same call with each kv "
                f"head repeated {groups}× (query head h must read kv head h // {groups})",
            )
            if exact:
                want = reference_attention(q, k, v, window=kern.module.cache_window, **kw)
                _expect(
                    _close(out, want, tol, tol),
                    record,
                    f"{what}: differs from reference_attention by {_maxdiff(out, want):.2e}",
                )


def _attention_bias(record, kernel, q, k, v, out, window, exact, tol, gen, dev) -> None:
    T = q.shape[2]
    bias = DistanceBias(torch.tensor(_SLOPES, device=dev))
    out_b = kernel(q, k, v, bias=bias, what="with a DistanceBias")
    _expect(
        _maxdiff(out_b, out) > 1e-3 or window == 1,  # a window of 1 leaves nothing to weigh
        record,
        "a DistanceBias does not change the output: the bias is ignored although the "
        "capability 'positions' includes 'score_bias'",
    )
    if exact:
        ref = reference_attention(q, k, v, bias=bias, window=window)
        _expect(
            _close(out_b, ref, tol, tol),
            record,
            f"with a DistanceBias, differs from reference_attention by {_maxdiff(out_b, ref):.2e}",
        )
    s = T // 2
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[:, :, s + 1 :] = _randn(gen, *t[:, :, s + 1 :].shape, device=dev, scale=10.0)
    out2 = kernel(q2, k2, v2, bias=bias, what="with a bias, future changed")
    _expect(
        _close(out2[:, :, : s + 1], out_b[:, :, : s + 1], 1e-6),
        record,
        f"not causal with a DistanceBias: changing positions after {s} changed earlier outputs",
    )
    for tq in (1, 3):
        part = kernel(q[:, :, -tq:], k, v, bias=bias, what=f"with a bias, last {tq} queries")
        _expect(
            _close(part, out_b[:, :, -tq:], 1e-5, 1e-5),
            record,
            f"with a DistanceBias, the last {tq} queries against all keys differ from the full "
            f"output by {_maxdiff(part, out_b[:, :, -tq:]):.2e}: the bias must be aligned "
            "bottom-right like the queries (bias.dense(Tq, Tk))",
        )


def _attention_padding(record, kernel, q, k, v, out, window, exact, tol, sites, gen, dev) -> None:
    B, _, T, _ = q.shape
    P = 3
    mask = torch.ones(B, T, dtype=torch.bool, device=dev)
    mask[1, :P] = False
    calls: list[dict[str, Any]] = [{}]
    if "score_bias" in sites:
        calls.append({"bias": DistanceBias(torch.tensor(_SLOPES, device=dev))})
    for kw in calls:
        tag = " and a bias" if kw else ""
        full = out if not kw else kernel(q, k, v, **kw)
        out_m = kernel(q, k, v, key_padding_mask=mask, what=f"key_padding_mask{tag}", **kw)
        _expect(
            _close(out_m[0], full[0], 1e-5, 1e-5),
            record,
            f"key_padding_mask{tag}: an all-True row changed the output "
            f"(max diff {_maxdiff(out_m[0], full[0]):.2e})",
        )
        k2, v2 = k.clone(), v.clone()
        k2[1, :, :P] = _randn(gen, *k2[1, :, :P].shape, device=dev, scale=10.0)
        v2[1, :, :P] = _randn(gen, *v2[1, :, :P].shape, device=dev, scale=10.0)
        out2 = kernel(q, k2, v2, key_padding_mask=mask, what=f"masked keys changed{tag}", **kw)
        _expect(
            _close(out2[1, :, P:], out_m[1, :, P:], 1e-6),
            record,
            f"key_padding_mask{tag}: changing masked keys/values changed the outputs of real "
            f"tokens (max diff {_maxdiff(out2[1, :, P:], out_m[1, :, P:]):.2e})",
        )
        sub = kernel(
            q[1:, :, P:], k[1:, :, P:], v[1:, :, P:], what=f"unpadded subsequence{tag}", **kw
        )
        _expect(
            _close(out_m[1:, :, P:], sub, 1e-5, 1e-5),
            record,
            f"key_padding_mask{tag}: a left-padded row differs from the same tokens without "
            f"padding by {_maxdiff(out_m[1:, :, P:], sub):.2e}",
        )
        last = kernel(
            q[:, :, -1:], k, v, key_padding_mask=mask, what=f"decode step with padding{tag}", **kw
        )
        _expect(
            _close(last, out_m[:, :, -1:], 1e-5, 1e-5),
            record,
            f"key_padding_mask{tag} with one query over all keys differs from the last row of "
            f"the full masked output by {_maxdiff(last, out_m[:, :, -1:]):.2e}",
        )
        if exact:
            ref = reference_attention(q, k, v, key_padding_mask=mask, window=window, **kw)
            _expect(
                _close(out_m[1, :, P:], ref[1, :, P:], tol, tol),
                record,
                f"key_padding_mask{tag}: differs from reference_attention by "
                f"{_maxdiff(out_m[1, :, P:], ref[1, :, P:]):.2e}",
            )


def _attention_noncausal(record, kernel, q, k, v, caps, exact, tol, gen, dev) -> None:
    T = q.shape[2]
    if caps.get("causal_only"):
        try:
            kernel.module(q, k, v, causal=False)
        except Exception:
            return
        _fail(
            record,
            "declares causal_only but accepted causal=False: it must raise rather than "
            "silently compute causal attention",
        )
    out = kernel(q, k, v, causal=False, what="causal=False")
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 3.0
    v2[:, :, -1] += 3.0
    out2 = kernel(q, k2, v2, causal=False, what="causal=False, last key changed")
    _expect(
        _maxdiff(out2[:, :, 0], out[:, :, 0]) > 1e-3,
        record,
        "with causal=False the first query ignores the last key: the flag is not honoured",
    )
    if exact:
        ref = reference_attention(q, k, v, causal=False)
        _expect(
            _close(out, ref, tol, tol),
            record,
            f"with causal=False, differs from reference_attention by {_maxdiff(out, ref):.2e}",
        )
    part = kernel(q[:, :, -3:], k, v, causal=False, what="causal=False, 3 queries over all keys")
    _expect(
        _close(part, out[:, :, -3:], 1e-5, 1e-5),
        record,
        f"with causal=False, 3 queries over all {T} keys differ from the same rows of the full "
        f"output by {_maxdiff(part, out[:, :, -3:]):.2e}",
    )
