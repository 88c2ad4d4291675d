"""Conformance checks for llmkit components, importable by plugin authors for their own CI.

Every check takes a registry :class:`~llmkit.registry.Component` record (and optionally a
dict of options) and raises :class:`AssertionError` with a message naming the component and
the property it broke; it returns ``None`` when the component conforms. A plugin's test suite
needs two lines::

    from llmkit.testing import check_component, conformance_params

    @pytest.mark.parametrize("record", conformance_params())
    def test_conforms(record):
        check_component(record)

Per kind (see each ``check_*`` function for the details):

- ``attention``: shapes and dtype, agreement with :func:`reference_attention`, causality,
  bottom-right alignment of queries to keys (how a KV cache presents them), sliding-window
  locality for kernels that declare a ``cache_window``, gradients, determinism, GQA/MQA,
  score biases, key padding masks, non-causal calls, bfloat16.
- ``ffn`` and ``norm``: shape and dtype, position-wise (no mixing across tokens or batch
  rows), gradients to the input and every parameter, determinism, bfloat16.
- ``position``: ``acts_on`` agrees with the record's capabilities, every site it does not
  declare is left alone, embeddings depend on position, rotary scores depend only on relative
  position, incremental (one token at a time) calls equal full ones, (B, T) positions.
- ``optimizer``: every trainable parameter in exactly one group, ``initial_lr`` on every
  group, a regression loss falls clearly in 50 steps, ``state_dict`` round trips exactly, the
  step follows ``group["lr"]`` (which schedules set).
- ``schedule``: warmup rises to a peak of 1.0, never negative, non-increasing over the last
  20% of steps, a pure function of the step.
- any other kind (plugins may add kinds): the options model validates its defaults (unless
  it has required fields, e.g. a dataset's paths) and the target loads as a callable.
  Register a check for it in :data:`KIND_CHECKS`.

Every kind: the options model is pydantic and rejects unknown keys.

:func:`check_model_combination` builds a tiny model from named parts through the spec loader
and checks training and KV-cache decoding end to end.

Capabilities the checks read (all optional): ``requires`` (``"cuda"`` selects the device and
skips the parameter without one), ``gqa`` and ``positions`` and ``causal_only`` and
``kv_cache`` (attention, as in ``registry.toml``), ``approximate`` (attention: True skips the
comparisons with :func:`reference_attention`), ``dtypes`` (model components: the dtypes to
test, default ``["float32", "bfloat16"]``), ``position_wise`` (ffn/norm: False skips the
no-mixing check, e.g. capacity-limited MoE routing), ``acts_on`` (position).

This module imports pytest only inside :func:`conformance_params`.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
from torch import Tensor, nn

from llmkit.contracts import POSITION_SITES, BuildContext, DistanceBias, SideOutputs

__all__ = [
    "KIND_CHECKS",
    "build_options",
    "check_attention",
    "check_component",
    "check_ffn",
    "check_generic",
    "check_model_combination",
    "check_norm",
    "check_optimizer",
    "check_options_model",
    "check_position",
    "check_schedule",
    "conformance_params",
    "init_like_model",
    "reference_attention",
    "small_context",
    "tiny_model_spec",
]

Record = Any  # llmkit.registry.Component (duck-typed: kind, name, provider, capabilities, ...)
Options = Mapping[str, Any] | None


# -- shared helpers ---------------------------------------------------------------------------


def _label(record: Record) -> str:
    return f"{record.kind} {record.name!r} (from {getattr(record, 'provider', '?')})"


def _fail(record: Record, message: str) -> NoReturn:
    raise AssertionError(f"{_label(record)}: {message}")


def _expect(condition: bool, record: Record, message: str) -> None:
    if not condition:
        _fail(record, message)


def _maxdiff(a: Tensor, b: Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.detach().float() - b.detach().float()).abs().max().item()


def _close(a: Tensor, b: Tensor, atol: float, rtol: float = 0.0) -> bool:
    return a.shape == b.shape and torch.allclose(
        a.detach().float(), b.detach().float(), atol=atol, rtol=rtol
    )


def _capabilities(record: Record) -> dict[str, Any]:
    return dict(getattr(record, "capabilities", None) or {})


def _device(record: Record, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if "cuda" in _capabilities(record).get("requires", []):
        return torch.device("cuda")
    return torch.device("cpu")


def _dtypes(record: Record) -> list[torch.dtype]:
    names = _capabilities(record).get("dtypes", ["float32", "bfloat16"])
    return [getattr(torch, n) for n in names]


def _tolerance(device: torch.device) -> float:
    """fp32 tolerance against a reference: GPUs may run matmuls in TF32."""
    return 1e-4 if device.type == "cpu" else 3e-3


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch inside, restoring the global RNG state afterwards."""
    devices = [] if device.type != "cuda" else [device.index or torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _randn(gen: torch.Generator, *shape: int, device: torch.device, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device)


def _run(record: Record, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``, turning an exception into an AssertionError that says what was tried."""
    try:
        return fn(*args, **kwargs)
    except AssertionError:
        raise
    except Exception as exc:
        _fail(record, f"{what} raised {type(exc).__name__}: {exc}")


def _load(record: Record) -> Any:
    try:
        target = record.load()
    except Exception as exc:
        _fail(record, f"its target failed to import: {type(exc).__name__}: {exc}")
    _expect(callable(target), record, f"its target {target!r} is not callable")
    return target


def _options_model(record: Record) -> Any:
    try:
        return record.options_model()
    except Exception as exc:
        _fail(record, f"its options model failed to load: {type(exc).__name__}: {exc}")


def build_options(record: Record, options: Options = None) -> Any:
    """The component's options instance, validated from ``options`` (default: all defaults)."""
    model = _options_model(record)
    try:
        return model.model_validate(dict(options or {}))
    except Exception as exc:
        what = "its default options" if not options else f"options {dict(options)!r}"
        _fail(record, f"{what} do not validate: {exc}")


def _option_fields(record: Record) -> set[str]:
    try:
        return set(getattr(record.options_model(), "model_fields", {}))
    except Exception:
        return set()


def small_context(**overrides: Any) -> BuildContext:
    """The BuildContext the checks use: d_model 32, 4 heads of 8, 2 kv heads, 64 positions."""
    values: dict[str, Any] = {
        "d_model": 32,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 8,
        "max_seq_len": 64,
        "n_layers": 2,
        "layer": 0,
        "dropout": 0.0,
        "bias": True,
    }
    values.update(overrides)
    return BuildContext(**values)


def init_like_model(module: nn.Module, std: float = 0.02) -> nn.Module:
    """Initialize a component the way :class:`llmkit.model.Transformer` does: a module with an
    ``init_weights(std)`` method initializes itself (and its children); otherwise ``nn.Linear``
    and ``nn.Embedding`` weights get Normal(0, std) and linear biases zeros."""
    owned: list[str] = []  # modules that initialized themselves, with their subtrees
    for name, mod in module.named_modules():
        if any(o == "" or name == o or name.startswith(o + ".") for o in owned):
            continue
        if callable(getattr(mod, "init_weights", None)):
            mod.init_weights(std)
            owned.append(name)
        elif isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, 0.0, std)
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.Embedding):
            nn.init.normal_(mod.weight, 0.0, std)
    return module


def _build_module(record: Record, options: Options, ctx: BuildContext, device: torch.device):
    factory = _load(record)
    opts = build_options(record, options)
    with _seeded(0, device):
        module = _run(record, f"building it with {ctx}", factory, opts, ctx)
        _expect(
            isinstance(module, nn.Module),
            record,
            f"building it returned {type(module).__name__}, not an nn.Module",
        )
        init_like_model(module)
    return _run(record, f"moving it with .to({str(device)!r})", module.to, device)


def _check_grads(record: Record, module: nn.Module, what: str) -> None:
    """Every trainable parameter of ``module`` got a finite, non-zero gradient."""
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        _expect(p.grad is not None, record, f"{what}: no gradient reaches parameter {name!r}")
        _expect(
            bool(torch.isfinite(p.grad).all()),
            record,
            f"{what}: the gradient of parameter {name!r} is not finite",
        )
        _expect(
            bool(p.grad.abs().sum() > 0),
            record,
            f"{what}: the gradient of parameter {name!r} is exactly zero",
        )


def _check_input_grad(record: Record, t: Tensor, name: str, what: str) -> None:
    _expect(t.grad is not None, record, f"{what}: no gradient reaches {name}")
    _expect(
        bool(torch.isfinite(t.grad).all()), record, f"{what}: the gradient of {name} is not finite"
    )
    _expect(bool(t.grad.abs().sum() > 0), record, f"{what}: the gradient of {name} is exactly zero")


def _check_side_outputs(record: Record, module: nn.Module) -> None:
    for name, mod in module.named_modules():
        if not isinstance(mod, SideOutputs):
            continue
        losses, _ = mod.pop_side_outputs()
        for key, value in losses.items():
            _expect(
                isinstance(value, Tensor) and value.numel() == 1,
                record,
                f"auxiliary loss {name or '.'}:{key} must be a scalar tensor, got {value!r}",
            )
            _expect(
                bool(torch.isfinite(value).all()),
                record,
                f"auxiliary loss {name or '.'}:{key} is not finite",
            )


# -- attention --------------------------------------------------------------------------------


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    bias: DistanceBias | None = None,
    key_padding_mask: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """The kernel contract in the plainest PyTorch, computed in fp32.

    q (B, Hq, Tq, D); k, v (B, Hkv, Tk, D); query i sits at key position Tk − Tq + i; query
    head h reads kv head h // (Hq/Hkv); ``bias`` adds ``bias.dense(Tq, Tk)``;
    ``key_padding_mask`` (B, Tk) is True where a key may be attended; ``window`` W keeps keys
    at positions p − W + 1 … p (causal only). A query left with no key returns zeros.
    """
    _, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    groups = hq // hkv
    kf = k.float().repeat_interleave(groups, dim=1)
    vf = v.float().repeat_interleave(groups, dim=1)
    scores = q.float() @ kf.transpose(-1, -2) / math.sqrt(d)
    if bias is not None:
        scores = scores + bias.dense(tq, tk, causal=causal).float().to(scores.device)[None]
    qpos = torch.arange(tk - tq, tk, device=q.device)[:, None]
    kpos = torch.arange(tk, device=q.device)[None, :]
    allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(device=q.device, dtype=torch.bool)[:, None, None]
    empty = ~allowed.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0)
    probs = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)
    return (probs @ vf).to(q.dtype)


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


# -- ffn and norm -----------------------------------------------------------------------------


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


def check_norm(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """Check a norm: the same generic properties as :func:`check_ffn` (nothing assumed about
    its statistics)."""
    _check_pointwise(record, options, device)


# -- position ---------------------------------------------------------------------------------


def check_position(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """Check a positional scheme against :class:`~llmkit.contracts.PositionalScheme`."""
    dev = _device(record, device)
    caps = _capabilities(record)
    ctx = small_context()
    module = _build_module(record, options, ctx, dev).eval()
    for method in ("embed", "rotate", "score_bias"):
        _expect(
            callable(getattr(module, method, None)),
            record,
            f"has no {method}() method (subclass llmkit.contracts.PositionalScheme)",
        )
    acts = frozenset(getattr(module, "acts_on", frozenset()))
    declared = frozenset(caps.get("acts_on", []))
    _expect(
        acts == declared,
        record,
        f"its class says acts_on={sorted(acts)} but its registry capabilities say "
        f"acts_on={sorted(declared)}; the spec checks compatibility from the capabilities",
    )
    unknown = acts - set(POSITION_SITES)
    _expect(not unknown, record, f"acts on unknown sites {sorted(unknown)}; know {POSITION_SITES}")

    B, T, C = 2, 8, ctx.d_model
    H, Hkv, D = ctx.n_heads, ctx.n_kv_heads, ctx.head_dim
    gen = torch.Generator().manual_seed(7)
    pos = torch.arange(T, device=dev)
    x = _randn(gen, B, T, C, device=dev)
    q = _randn(gen, B, H, T, D, device=dev)
    k = _randn(gen, B, Hkv, T, D, device=dev)

    def embed(inp: Tensor, p: Tensor, what: str) -> Tensor:
        before = inp.detach().clone()
        desc = f"embed ({what}; x {tuple(inp.shape)} {inp.dtype}, positions {tuple(p.shape)})"
        y = _run(record, desc, module.embed, inp, p)
        _expect(
            isinstance(y, Tensor) and y.shape == inp.shape,
            record,
            f"{desc} returned {getattr(y, 'shape', y)!r}, expected shape {tuple(inp.shape)}",
        )
        _expect(y.dtype == inp.dtype, record, f"{desc} returned dtype {y.dtype}")
        _expect(bool(torch.isfinite(y).all()), record, f"{desc} returned non-finite values")
        _expect(torch.equal(inp.detach(), before), record, f"{desc} modified x in place")
        return y

    def rotate(qq: Tensor, kk: Tensor, p: Tensor, what: str) -> tuple[Tensor, Tensor]:
        before = (qq.detach().clone(), kk.detach().clone())
        desc = f"rotate ({what}; q {tuple(qq.shape)} {qq.dtype}, positions {tuple(p.shape)})"
        res = _run(record, desc, module.rotate, qq, kk, p)
        _expect(isinstance(res, tuple) and len(res) == 2, record, f"{desc} must return (q, k)")
        for name, new, old in zip("qk", res, (qq, kk)):
            _expect(
                isinstance(new, Tensor) and new.shape == old.shape and new.dtype == old.dtype,
                record,
                f"{desc} returned {name} {getattr(new, 'shape', new)!r} "
                f"{getattr(new, 'dtype', '')}, expected {tuple(old.shape)} {old.dtype}",
            )
            _expect(bool(torch.isfinite(new).all()), record, f"{desc} returned non-finite {name}")
        _expect(
            torch.equal(qq.detach(), before[0]) and torch.equal(kk.detach(), before[1]),
            record,
            f"{desc} modified q or k in place",
        )
        return res

    def scores(qq: Tensor, kk: Tensor) -> Tensor:
        return qq.float() @ kk.float().repeat_interleave(H // Hkv, 1).transpose(-1, -2)

    with torch.no_grad():
        ex = embed(x, pos, "positions 0..T-1")
        rq, rk = rotate(q, k, pos, "positions 0..T-1")
        bias = _run(record, "score_bias()", module.score_bias)

        # Sites it does not declare are left alone (the spec only checks declared sites).
        if "embedding" not in acts:
            _expect(torch.equal(ex, x), record, "embed changes x but acts_on lacks 'embedding'")
        if "qk" not in acts:
            _expect(
                torch.equal(rq, q) and torch.equal(rk, k),
                record,
                "rotate changes q/k but acts_on lacks 'qk'",
            )
        if "score_bias" not in acts:
            _expect(bias is None, record, "score_bias() is not None but acts_on lacks 'score_bias'")

        if "embedding" in acts:
            same = x[:, :1].expand(B, T, C).contiguous()
            es = embed(same, pos, "one token at every position")
            constant = _maxdiff(es[:, 1:], es[:, :1].expand_as(es[:, 1:])) == 0
            if constant and next(module.parameters(), None) is not None:
                for p in module.parameters():  # e.g. a table initialized to zeros
                    p.add_(torch.randn(p.shape, generator=gen).to(p) * 0.02)
                es = embed(same, pos, "one token at every position, parameters perturbed")
                rq, rk = rotate(q, k, pos, "positions 0..T-1, parameters perturbed")
            _expect(
                _maxdiff(es[:, 1:], es[:, :1].expand_as(es[:, 1:])) > 0,
                record,
                "acts on 'embedding' but embed gives the same output for the same token at "
                "every position",
            )
            ex = embed(x, pos, "positions 0..T-1")
        if "qk" in acts:
            last = ctx.max_seq_len - T
            sq, sk = rotate(q, k, pos + last, f"positions shifted by {last}")
            base = scores(rq, rk)
            shifted = scores(sq, sk)
            _expect(
                _close(shifted, base, 1e-4, 1e-4),
                record,
                f"acts on 'qk' but rotated scores q·kᵀ change by {_maxdiff(shifted, base):.2e} "
                f"when every position shifts by {last}: they must depend only on relative position",
            )
            wq, wk = rotate(q, k, pos * 2, "positions 0, 2, 4, ...")
            _expect(
                _maxdiff(scores(wq, wk), base) > 1e-4,
                record,
                "acts on 'qk' but rotated scores do not change when relative positions double",
            )
        if "score_bias" in acts:
            _expect(
                isinstance(bias, DistanceBias),
                record,
                f"acts on 'score_bias' but score_bias() returned {type(bias).__name__}, "
                "not a DistanceBias",
            )
            slopes = bias.slopes
            _expect(
                isinstance(slopes, Tensor) and tuple(slopes.shape) == (H,),
                record,
                f"DistanceBias slopes must have shape (n_heads,) = ({H},), "
                f"got {getattr(slopes, 'shape', slopes)!r}",
            )
            _expect(bool(torch.isfinite(slopes).all()), record, "DistanceBias slopes not finite")
            dense = _run(record, "DistanceBias.dense(3, 8)", bias.dense, 3, 8)
            _expect(tuple(dense.shape) == (H, 3, 8), record, "DistanceBias.dense shape is wrong")

        # Incremental calls (what a KV cache does) equal the full call, position by position.
        for p in (0, T // 2, T - 1):
            one = torch.tensor([p], device=dev)
            e1 = embed(x[:, p : p + 1], one, f"one token at position {p}")
            _expect(
                _close(e1, ex[:, p : p + 1], 1e-6, 1e-6),
                record,
                f"embed of one token at position {p} differs from row {p} of the full call",
            )
            q1, k1 = rotate(q[:, :, p : p + 1], k[:, :, p : p + 1], one, f"position {p} alone")
            _expect(
                _close(q1, rq[:, :, p : p + 1], 1e-6, 1e-6)
                and _close(k1, rk[:, :, p : p + 1], 1e-6, 1e-6),
                record,
                f"rotate of one token at position {p} differs from row {p} of the full call",
            )

        # (B, T) positions: row b gets its own positions (left padding shifts them).
        pos_bt = torch.stack([pos, pos + 3])
        e_bt = embed(x, pos_bt, "(B, T) positions")
        e_shift = embed(x[1:], pos + 3, "positions 3..T+2")
        _expect(
            _close(e_bt[:1], ex[:1], 1e-6, 1e-6) and _close(e_bt[1:], e_shift, 1e-6, 1e-6),
            record,
            "embed with (B, T) positions differs from calling each row with its (T,) positions",
        )
        q_bt, k_bt = rotate(q, k, pos_bt, "(B, T) positions")
        q_sh, k_sh = rotate(q[1:], k[1:], pos + 3, "positions 3..T+2")
        _expect(
            _close(q_bt[:1], rq[:1], 1e-6, 1e-6)
            and _close(k_bt[:1], rk[:1], 1e-6, 1e-6)
            and _close(q_bt[1:], q_sh, 1e-6, 1e-6)
            and _close(k_bt[1:], k_sh, 1e-6, 1e-6),
            record,
            "rotate with (B, T) positions differs from calling each row with its (T,) positions",
        )
        for dtype in _dtypes(record):
            if dtype == torch.float32:
                continue
            lq, lk = rotate(q.to(dtype), k.to(dtype), pos, f"{dtype} q/k")
            _expect(
                max(_maxdiff(lq, rq), _maxdiff(lk, rk)) <= 5e-2 * max(1.0, rq.abs().max().item()),
                record,
                f"rotate in {dtype} differs from float32 by "
                f"{max(_maxdiff(lq, rq), _maxdiff(lk, rk)):.2e}",
            )
            le = embed(x.to(dtype), pos, f"{dtype} x")
            _expect(
                _maxdiff(le, ex) <= 5e-2 * max(1.0, ex.abs().max().item()),
                record,
                f"embed in {dtype} differs from float32 by {_maxdiff(le, ex):.2e}",
            )

    # Gradients flow through embed and rotate to their inputs and to every parameter.
    module.train()
    xg = x.detach().clone().requires_grad_(True)
    qg, kg = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    y = embed(xg, pos, "backward")
    rq2, rk2 = rotate(qg, kg, pos, "backward")
    loss = (y * _randn(gen, *y.shape, device=dev)).sum() + scores(rq2, rk2).tanh().sum()
    b = module.score_bias()
    if isinstance(b, DistanceBias) and isinstance(b.slopes, Tensor) and b.slopes.requires_grad:
        loss = loss + b.dense(4, 4).sum()
    loss.backward()
    _check_input_grad(record, xg, "x", "backward through embed")
    _check_input_grad(record, qg, "q", "backward through rotate")
    _check_input_grad(record, kg, "k", "backward through rotate")
    _check_grads(record, module, "backward through embed/rotate/score_bias")
    module.eval()


# -- optimizer --------------------------------------------------------------------------------


class _TinyNet(nn.Module):
    """Embedding → LayerNorm → Linear, plus a parameter the forward never uses."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)
        self.unused = nn.Linear(dim, 2)  # never gets a gradient

    def forward(self, idx: Tensor) -> Tensor:
        return self.lin(self.norm(self.emb(idx)))


def check_optimizer(
    record: Record,
    options: Options = None,
    *,
    device: str | torch.device | None = None,
    steps: int = 50,
    min_reduction: float = 0.3,
) -> None:
    """Check an optimizer factory ``build(model, options) -> torch.optim.Optimizer``.

    Options default to ``{"lr": 1e-2}`` when the options model has an ``lr`` field. The
    regression loss (fitting a teacher network) must fall by at least ``min_reduction`` of its
    initial value in ``steps`` steps.
    """
    dev = _device(record, device)
    build = _load(record)
    opts_dict = dict(options or {})
    if "lr" in _option_fields(record) and "lr" not in opts_dict:
        opts_dict["lr"] = 1e-2
    opts = build_options(record, opts_dict)
    with _seeded(0, dev):
        model = _TinyNet().to(dev)
        teacher = _TinyNet().to(dev)
    idx = torch.arange(16, device=dev).repeat(2)
    with torch.no_grad():
        target = teacher(idx)

    def loss_of(m: nn.Module) -> Tensor:
        return nn.functional.mse_loss(m(idx), target)

    def make(m: nn.Module, what: str) -> torch.optim.Optimizer:
        opt = _run(record, what, build, m, opts)
        _expect(
            isinstance(opt, torch.optim.Optimizer),
            record,
            f"{what} returned {type(opt).__name__}, not a torch.optim.Optimizer",
        )
        return opt

    opt = make(model, f"build(model, {opts!r})")
    seen: dict[int, int] = {}
    for i, group in enumerate(opt.param_groups):
        _expect(
            "initial_lr" in group,
            record,
            f"param group {i} has no 'initial_lr' (schedules scale it; see "
            "llmkit.optim.set_initial_lr)",
        )
        _expect(
            isinstance(group["initial_lr"], float | int) and group["initial_lr"] > 0,
            record,
            f"param group {i} has initial_lr {group['initial_lr']!r}",
        )
        _expect(
            group["lr"] == group["initial_lr"],
            record,
            f"param group {i}: lr {group['lr']} != initial_lr {group['initial_lr']} after build",
        )
        for p in group["params"]:
            seen[id(p)] = seen.get(id(p), 0) + 1
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [n for i, n in names.items() if i not in seen]
    twice = [names.get(i, "?") for i, c in seen.items() if c > 1]
    _expect(not missing, record, f"trainable parameters missing from every group: {missing}")
    _expect(not twice, record, f"parameters in more than one group: {twice}")

    unused = [p.detach().clone() for p in model.unused.parameters()]
    with torch.no_grad():
        first = loss_of(model).item()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model)
        loss.backward()
        _run(record, f"step {step}", opt.step)
    with torch.no_grad():
        last = loss_of(model).item()
    _expect(math.isfinite(last), record, f"the loss is {last} after {steps} steps")
    _expect(
        last <= (1 - min_reduction) * first,
        record,
        f"{steps} steps took a regression loss from {first:.4f} only to {last:.4f} "
        f"(needs ≤ {(1 - min_reduction) * first:.4f}) with options {opts!r}",
    )
    _expect(
        all(torch.equal(a, p) for a, p in zip(unused, model.unused.parameters())),
        record,
        "changed parameters that never had a gradient (grad is None)",
    )

    def clone() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = copy.deepcopy(model)
        o = make(m, "building a second optimizer")
        _run(record, "load_state_dict", o.load_state_dict, copy.deepcopy(opt.state_dict()))
        return m, o

    def grad_step(m: nn.Module, o: torch.optim.Optimizer) -> None:
        o.zero_grad(set_to_none=True)
        loss_of(m).backward()
        _run(record, "a step after load_state_dict", o.step)

    (m1, o1), (m2, o2) = clone(), clone()
    before = [p.detach().clone() for p in model.parameters()]
    grad_step(model, opt)
    grad_step(m1, o1)
    for (name, a), b in zip(model.named_parameters(), m1.parameters()):
        _expect(
            torch.equal(a, b),
            record,
            f"after state_dict → load_state_dict into a fresh optimizer, the next step differs "
            f"for {name!r} by {_maxdiff(a, b):.2e}",
        )
    for group in o2.param_groups:  # what a schedule does: lr = initial_lr * factor
        group["lr"] = group["initial_lr"] * 0.25
    grad_step(m2, o2)
    full = torch.cat([(a - b).flatten() for a, b in zip(model.parameters(), before)])
    quarter = torch.cat([(a - b).flatten() for a, b in zip(m2.parameters(), before)])
    _expect(
        _maxdiff(full, quarter) > 1e-3 * full.abs().max().item(),
        record,
        "setting group['lr'] to a quarter did not change the step: the optimizer must read "
        "each group's lr at every step (schedules set it)",
    )


# -- schedule ---------------------------------------------------------------------------------


def check_schedule(
    record: Record,
    options: Options = None,
    *,
    total_steps: int = 100,
    warmup_steps: int = 10,
    device: str | torch.device | None = None,
) -> None:
    """Check a schedule factory ``build(options, *, total_steps) -> (step -> lr factor)``.

    With a ``warmup_steps`` option (set to ``warmup_steps`` unless given): the factor rises
    during warmup and reaches 1.0 at its end. Always: the peak is 1.0, the factor is never
    negative (also past ``total_steps``), non-increasing over the last 20% of steps, and a
    pure function of the step. ``device`` is accepted for a uniform signature and unused.
    """
    build = _load(record)
    fields = _option_fields(record)
    opts_dict = dict(options or {})
    if "warmup_steps" in fields:
        opts_dict.setdefault("warmup_steps", warmup_steps)
    opts = build_options(record, opts_dict)
    fn = _run(
        record, f"build({opts!r}, total_steps={total_steps})", build, opts, total_steps=total_steps
    )
    _expect(callable(fn), record, f"build returned {type(fn).__name__}, not a callable")
    steps = range(total_steps + total_steps // 5)
    values = []
    for s in steps:
        f = _run(record, f"the factor at step {s}", fn, s)
        try:
            f = float(f)
        except (TypeError, ValueError):
            _fail(record, f"the factor at step {s} is {f!r}, not a number")
        _expect(math.isfinite(f), record, f"the factor at step {s} is {f}")
        _expect(f >= 0, record, f"the factor at step {s} is negative ({f})")
        values.append(f)
    again = [float(fn(s)) for s in reversed(steps)][::-1]
    _expect(
        again == values,
        record,
        "the factor depends on call order or history, not only on the step (resuming from a "
        "checkpoint would change the schedule)",
    )
    peak = max(values[:total_steps])
    _expect(
        abs(peak - 1.0) <= 1e-3,
        record,
        f"the peak factor is {peak:.4f}; 1.0 (the optimizer's base lr) must be reached",
    )
    warm = getattr(opts, "warmup_steps", 0) or 0
    if warm > 1:
        ramp = values[:warm]
        _expect(
            all(b > a for a, b in itertools.pairwise(ramp)),
            record,
            f"the factor does not rise during {warm} warmup steps: {ramp}",
        )
        _expect(ramp[0] < 1.0, record, f"the factor at step 0 is already {ramp[0]} despite warmup")
        _expect(
            abs(max(values[warm - 1], values[warm]) - 1.0) <= 1e-3,
            record,
            f"the factor at the end of warmup (steps {warm - 1}, {warm}) is "
            f"{values[warm - 1]:.4f}, {values[warm]:.4f}, not 1.0",
        )
    tail_start = total_steps - total_steps // 5
    tail = values[tail_start:total_steps]
    for i, (a, b) in enumerate(itertools.pairwise(tail)):
        _expect(
            b <= a + 1e-9,
            record,
            f"the factor increases from step {tail_start + i} ({a:.4f}) to "
            f"{tail_start + i + 1} ({b:.4f}) in the last 20% of {total_steps} steps",
        )
    if "warmup_steps" in fields and "warmup_steps" not in dict(options or {}):
        zero = build_options(record, {**opts_dict, "warmup_steps": 0})
        fn0 = _run(record, "build with warmup_steps=0", build, zero, total_steps=total_steps)
        _expect(
            abs(float(fn0(0)) - 1.0) <= 1e-3,
            record,
            f"with warmup_steps=0 the factor at step 0 is {float(fn0(0)):.4f}, not 1.0",
        )


# -- other kinds and dispatch -----------------------------------------------------------------


def check_options_model(record: Record, options: Options = None) -> None:
    """The options model is a pydantic model that rejects unknown keys (so a misspelled
    option in a spec is an error, not silently ignored)."""
    model = _options_model(record)
    _expect(
        hasattr(model, "model_validate") and hasattr(model, "model_fields"),
        record,
        f"its options model {model!r} is not a pydantic model",
    )
    probe = {**dict(options or {}), "conformance_unknown_key": 1}
    try:
        model.model_validate(probe)
    except Exception as exc:
        errors = getattr(exc, "errors", lambda: [])()
        if any(e.get("type") == "extra_forbidden" for e in errors):
            return
    _fail(
        record,
        f"its options model {model.__name__} accepts unknown keys; forbid them "
        "(subclass llmkit.contracts.ComponentOptions)",
    )


def check_generic(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """For kinds without a dedicated check: the options model forbids unknown keys and
    validates ``options`` (or its defaults, unless it has required fields and no ``options``
    are given), and the target loads as a callable."""
    check_options_model(record, options)
    required = [n for n, f in _options_model(record).model_fields.items() if f.is_required()]
    if options or not required:
        build_options(record, options)
    _load(record)


KIND_CHECKS: dict[str, Callable[..., None]] = {
    "attention": check_attention,
    "ffn": check_ffn,
    "norm": check_norm,
    "position": check_position,
    "optimizer": check_optimizer,
    "schedule": check_schedule,
}
"""Checks by kind; a plugin adding a kind may add its own ``check(record, options, *, device)``."""


def check_component(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """Run the conformance checks for ``record``'s kind (:func:`check_generic` for kinds
    without one). Raises AssertionError naming the component and the broken property."""
    check_options_model(record, options)
    check = KIND_CHECKS.get(record.kind, check_generic)
    check(record, options, device=device)


def _unmet_requirements(record: Record) -> list[str]:
    unmet = []
    for req in _capabilities(record).get("requires", []):
        if req == "cuda" and not torch.cuda.is_available():
            unmet.append("cuda")
    return unmet


def conformance_params(kind: str | None = None, registry: Any = None) -> list[Any]:
    """``pytest.param(record, id="kind.name")`` for every registered component (of ``kind``),
    built-in or from a plugin; components whose ``requires`` cannot be met here are skipped."""
    import pytest

    if registry is None:
        from llmkit.registry import get_registry

        registry = get_registry()
    params = []
    for record in registry.list(kind):
        unmet = _unmet_requirements(record)
        marks = [pytest.mark.skip(reason=f"requires {', '.join(unmet)}")] if unmet else []
        params.append(pytest.param(record, id=f"{record.kind}.{record.name}", marks=marks))
    return params


# -- whole models -----------------------------------------------------------------------------

ComponentRef = str | Mapping[str, Any]


def _ref(value: ComponentRef) -> dict[str, Any]:
    return {"name": value} if isinstance(value, str) else dict(value)


def tiny_model_spec(
    attention: ComponentRef,
    position: ComponentRef,
    ffn: ComponentRef,
    norm: ComponentRef,
    **model: Any,
) -> dict[str, Any]:
    """A spec dict for a tiny model (vocab 64, d_model 32, 2 layers, 4 heads, 2 kv heads,
    16 positions) with the given parts; ``model`` overrides or adds ``[model]`` fields."""
    fields: dict[str, Any] = {
        "vocab_size": 64,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "max_seq_len": 16,
        "attention": _ref(attention),
        "position": _ref(position),
        "ffn": _ref(ffn),
        "norm": _ref(norm),
    }
    fields.update(model)
    return {"model": fields}


def check_model_combination(
    attention: ComponentRef,
    position: ComponentRef,
    ffn: ComponentRef,
    norm: ComponentRef,
    *,
    model: Mapping[str, Any] | None = None,
    registry: Any = None,
    device: str | torch.device | None = None,
    seed: int = 0,
) -> Any:
    """Build a tiny model from the named parts (each a name or ``{"name": ..., **options}``)
    through :func:`llmkit.spec.load_spec_dict` and check it end to end: forward with targets
    gives finite logits and loss, backward reaches every parameter, logits are causal and
    deterministic, and, when the attention has the ``kv_cache`` capability, decoding through
    the KV cache (a prompt, a chunk, then token by token) equals the full forward.

    ``model`` overrides ``[model]`` fields (see :func:`tiny_model_spec`); ``n_kv_heads``
    defaults to 2, or 4 (= n_heads) when the attention has ``gqa = false``. A spec that is
    refused raises :class:`llmkit.errors.SpecError` (not caught). Returns the model.
    """
    from llmkit.errors import RegistryError
    from llmkit.model import build_model
    from llmkit.spec import load_spec_dict

    if registry is None:
        from llmkit.registry import get_registry

        registry = get_registry()
    att_name = _ref(attention).get("name")
    try:
        att_record = registry.get("attention", att_name)
    except RegistryError:
        att_record = None  # load_spec_dict reports it
    fields = dict(model or {})
    if att_record is not None and att_record.capabilities.get("gqa") is False:
        fields.setdefault("n_kv_heads", fields.get("n_heads", 4))
    spec = tiny_model_spec(attention, position, ffn, norm, **fields)
    rs = load_spec_dict(spec, registry=registry)
    attention_caps = [plan.attention.record.capabilities for plan in rs.layers]
    kv_cache = bool(attention_caps) and all(c.get("kv_cache") for c in attention_caps)
    requires = {r for c in attention_caps for r in c.get("requires", [])}
    dev = torch.device(device) if device else torch.device("cuda" if "cuda" in requires else "cpu")
    label = f"model with {_describe(spec['model'])}"

    def expect(cond: bool, message: str) -> None:
        if not cond:
            raise AssertionError(f"{label}: {message}")

    def run(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except AssertionError:
            raise
        except Exception as exc:
            raise AssertionError(f"{label}: {what} raised {type(exc).__name__}: {exc}") from exc

    with _seeded(seed, dev):
        net = run("build_model", build_model, rs)
        net = run(f".to({str(dev)!r})", net.to, dev)
    m = rs.model
    B, T, V = 2, m.max_seq_len, m.vocab_size
    gen = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, V, (B, T), generator=gen).to(dev)
    targets = torch.randint(0, V, (B, T), generator=gen).to(dev)

    net.train()
    out = run("forward with targets", net, idx, targets)
    expect(out.logits.shape == (B, T, V), f"logits have shape {tuple(out.logits.shape)}")
    expect(bool(torch.isfinite(out.logits).all()), "logits are not finite")
    expect(out.loss is not None and bool(torch.isfinite(out.loss)), f"loss is {out.loss}")
    for key, value in out.aux_losses.items():
        expect(bool(torch.isfinite(value).all()), f"auxiliary loss {key} is not finite")
    run("backward", out.total_loss.backward)
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        expect(p.grad is not None, f"no gradient reaches {name}")
        expect(bool(torch.isfinite(p.grad).all()), f"the gradient of {name} is not finite")
        expect(bool(p.grad.abs().sum() > 0), f"the gradient of {name} is exactly zero")

    net.eval()
    with torch.no_grad():
        full = run("eval forward", net, idx).logits
        expect(torch.equal(full, net(idx).logits), "two eval forwards differ (not deterministic)")
        with _seeded(seed, dev):
            twin = build_model(rs).to(dev).eval()
        expect(
            torch.equal(full, twin(idx).logits),
            "a second model built under the same seed gives different logits",
        )
        cut = T // 2
        changed = idx.clone()
        changed[:, cut:] = (changed[:, cut:] + 1) % V
        other = net(changed).logits
        expect(
            _close(other[:, :cut], full[:, :cut], 1e-5, 1e-5),
            f"not causal: changing tokens from position {cut} on changed earlier logits "
            f"(max diff {_maxdiff(other[:, :cut], full[:, :cut]):.2e})",
        )
        expect(_maxdiff(other[:, cut:], full[:, cut:]) > 0, "changing tokens changed no logits")
        if kv_cache:
            cache = run("new_cache", net.new_cache)
            pieces = [(0, 5), (5, 8)] + [(t, t + 1) for t in range(8, T)]
            got = []
            for a, b in pieces:
                step = run(
                    f"decoding tokens {a}..{b - 1} with the cache", net, idx[:, a:b], cache=cache
                )
                got.append(step.logits)
            inc = torch.cat(got, dim=1)
            atol = _tolerance(dev)
            expect(
                _close(inc, full, atol, atol),
                f"KV-cache decoding (prompt of 5, a chunk of 3, then one token at a time) "
                f"differs from the full forward by {_maxdiff(inc, full):.2e}",
            )
            expect(cache.position == T, f"the cache position is {cache.position}, not {T}")
    return net


def _describe(model: Mapping[str, Any]) -> str:
    parts = []
    for slot in ("attention", "position", "ffn", "norm"):
        ref = model[slot]
        opts = {k: v for k, v in ref.items() if k != "name"}
        parts.append(f"{slot}={ref['name']}{opts if opts else ''}")
    extra = {
        k: v
        for k, v in model.items()
        if k not in ("attention", "position", "ffn", "norm")
        and k not in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len")
    }
    return ", ".join(parts) + (f" ({extra})" if extra else "")
