"""Timing attention, ffn and norm kernels across every registered component
(``llmkit bench kernels``, ``benchmarks/test_kernels.py``, ``benchmarks/gpu_check.py``).

Every component of a kind is built from the registry with its default options (or options
given per component), so a plugin's kernel joins without edits. A component that cannot run a
case is skipped with a reason, never special-cased by name: its capabilities say so
(``requires = ["cuda"]`` off a GPU, ``causal_only`` for a non-causal case), its options do
not validate, or it raises ``NotImplementedError``, ``ValueError`` or out-of-memory on a
trial call.

What each record holds (:func:`bench_kernels` returns a list of dicts):

- ``median_s`` / ``min_s``: median and fastest per-call time over ``repeats`` repeats, each
  of ``number`` back-to-back calls (``number`` calibrated so one repeat lasts ≳ 5 ms), after
  ``warmup`` calls (the first call compiles Triton kernels). On CUDA the calls are timed with
  CUDA events; on a CPU with ``time.perf_counter``.
- ``flops`` and ``tflops`` (= flops / median_s / 1e12), useful work only:

  - attention: forward ``4·B·H·D·P``, with ``P`` the attended (query, key) pairs:
    ``N²`` non-causal, ``N²/2`` causal, ``N·w − w²/2`` for a sliding window of ``W`` keys
    (``w = min(W, N)``; equals ``N²/2`` at ``w = N``). The window is read from the kernel's
    ``cache_window`` (the :class:`~llmkit.contracts.AttentionKernel` contract), so any
    windowed kernel is counted the same way. Backward is 2.5× forward, so forward+backward is
    3.5×. Masked-out pairs a kernel computes anyway (a dense kernel's upper triangle, a
    block-local kernel's band edges) are not counted.
  - ffn: the matmul FLOPs torch's ``FlopCounterMode`` sees in one forward (so a MoE counts
    only the experts its tokens visit); if it sees none (a kernel doing its matmuls outside
    torch), ``2 · tokens · Σ (2-D weight elements)``. Backward 2× forward.
  - norm: no FLOPs (memory bound); ``gbps`` instead: bytes of the activations read and
    written, ``2·tokens·C·itemsize`` forward (x in, y out) and ``5·tokens·C·itemsize``
    forward+backward (x, y; then x, dy in and dx out), over the median time.
- ``peak_memory_bytes``: the peak of memory allocated by one call above what was live before
  it, measured in one extra, untimed call. Inputs and weights are excluded; outputs, saved
  activations, gradients and temporaries are included.

  - CUDA: ``torch.cuda.max_memory_allocated()`` − ``torch.cuda.memory_allocated()`` after
    ``reset_peak_memory_stats``.
  - CPU: torch's own allocator events. The call runs under ``torch.profiler`` with
    ``profile_memory=True``; the CPU allocator then reports every allocation and free with its
    size, and the peak of their running sum is the figure. This counts exactly the bytes of
    the tensors torch allocates (what ``max_memory_allocated`` counts on CUDA); it misses
    memory a library allocates outside torch's allocator. ``tracemalloc`` does not see torch
    at all, and the process's resident set under-counts: freed blocks are reused from the
    heap without growing it (SDPA at B·H = 8, N = 4096, D = 64, fp32: forward 9.3 MiB of
    allocations and no resident-set growth, forward+backward 42.1 vs 22.0 MiB); only for
    huge allocations do they nearly agree (dense forward: 1056 vs 1024 MiB).

- ``speedup`` and ``memory_ratio`` (after :func:`add_ratios`): the baseline component's
  median time (peak memory) divided by this one's on the same case; > 1 is faster (smaller).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmkit.contracts import BuildContext

KINDS = ("attention", "ffn", "norm")
MODES = ("fwd", "fwd+bwd")
#: The component every other one is compared with, per kind.
BASELINES = {"attention": "sdpa", "ffn": "swiglu", "norm": "rmsnorm"}

#: Sequence lengths (attention) and token counts (ffn, norm): the default sweeps.
SEQ_LENS = {"cpu": (256, 512, 1024, 2048, 4096), "cuda": (512, 1024, 2048, 4096, 8192)}
TOKENS = {"cpu": (256, 1024, 4096), "cuda": (4096, 16384, 65536)}
HEAD_DIMS = (64, 128)
D_MODEL = {"cpu": 768, "cuda": 4096}
#: ``--quick``: tiny shapes, a couple of seconds in all.
QUICK = {"seq_lens": (64, 128), "tokens": (64, 256), "head_dims": (64,), "d_model": 64}

ATTENTION_FLOPS = (
    "forward 4·B·H·D·P, P = attended (query, key) pairs: N² non-causal, N²/2 causal, "
    "N·w − w²/2 with a window W (w = min(W, N)); backward 2.5× forward"
)
FFN_FLOPS = "matmul FLOPs counted by torch's FlopCounterMode in one forward; backward 2× forward"
NORM_BYTES = "bytes of activations: 2·T·C·itemsize forward, 5·T·C·itemsize forward+backward"
CPU_MEMORY = "torch.profiler(profile_memory=True): peak of the CPU allocator's running total"
CUDA_MEMORY = "torch.cuda.max_memory_allocated above the allocation before the call"

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class Unsupported(Exception):
    """A component that cannot run a case; the message says why (the record is skipped)."""


@dataclass
class Entry:
    """One line of a comparison: a registered component, the options to build it with, and
    an optional context manager every call runs in (e.g. forcing an SDPA backend)."""

    label: str
    record: Any  # llmkit.registry.Component
    options: dict[str, Any] = field(default_factory=dict)
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None


@dataclass
class Prepared:
    """A ready-to-time call of one component on one case."""

    step: Callable[[], Any]
    flops: float | None
    bytes_moved: float | None
    info: dict[str, Any]


def parse_dtype(name: str, device: str) -> torch.dtype:
    """A dtype from its name; fp16 only on CUDA (CPU fp16 matmuls are 100× slower)."""
    dtype = DTYPES.get(name.lower())
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; expected float32, bfloat16 or float16")
    if dtype is torch.float16 and device != "cuda":
        raise ValueError("float16 needs a CUDA GPU (on a CPU use float32 or bfloat16)")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- FLOP and byte counts ---------------------------------------------------------------------


def attention_pairs(seq_len: int, *, causal: bool = True, window: int | None = None) -> float:
    """Attended (query, key) pairs of self-attention over ``seq_len`` tokens (see the module
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
    return fwd * _mode_factor(mode, backward=2.5)


def _mode_factor(mode: str, *, backward: float) -> float:
    if mode == "fwd":
        return 1.0
    if mode == "fwd+bwd":
        return 1.0 + backward
    raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")


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
    _pop_side_outputs(module)
    fwd = float(counter.get_total_flops())
    if fwd <= 0:
        tokens = x.numel() // x.shape[-1]
        weights = sum(p.numel() for p in module.parameters() if p.dim() >= 2)
        fwd = 2.0 * tokens * weights
    return fwd * _mode_factor(mode, backward=2.0)


# -- building and calling components ----------------------------------------------------------


def entries(
    kind: str,
    names: Sequence[str] | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    registry: Any = None,
) -> list[Entry]:
    """Entries for ``names`` (default: every registered component of ``kind``, in registry
    order). Unknown names raise the registry's error (with a did-you-mean)."""
    if registry is None:
        from llmkit.registry import get_registry

        registry = get_registry()
    options = options or {}
    records = [registry.get(kind, n) for n in names] if names else registry.list(kind)
    return [Entry(r.name, r, dict(options.get(r.name, {}))) for r in records]


def _check_capabilities(entry: Entry, device: str, causal: bool = True) -> None:
    caps = dict(getattr(entry.record, "capabilities", None) or {})
    for req in caps.get("requires", []):
        if req == "cuda" and device != "cuda":
            raise Unsupported("requires cuda")
    if not causal and caps.get("causal_only"):
        raise Unsupported("causal only (capability causal_only)")


def build(entry: Entry, ctx: BuildContext, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The entry's module on ``device`` in ``dtype``; options that do not validate (e.g. a
    required option without a value) raise Unsupported."""
    try:
        opts = entry.record.parse_options(entry.options)
    except Exception as exc:
        what = "default options" if not entry.options else f"options {entry.options!r}"
        raise Unsupported(f"{what} do not validate: {_one_line(exc)}") from exc
    module = entry.record.load()(opts, ctx)
    return module.to(device=device, dtype=dtype)


def _option_problems(exc: BaseException) -> str:
    """A pydantic error as ``key: message`` pairs on one line; others as :func:`_one_line`."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _pop_side_outputs(module: torch.nn.Module) -> None:
    pop = getattr(module, "pop_side_outputs", None)
    if callable(pop):
        pop()


def _wrap(entry: Entry, fn: Callable[[], Any]) -> Callable[[], Any]:
    if entry.context is None:
        return fn
    context = entry.context

    def step() -> Any:
        with context():
            return fn()

    return step


def _trial(step: Callable[[], Any], device: str) -> None:
    """One call; the exceptions that mean "cannot run this case" become Unsupported."""
    try:
        step()
        _sync(device)
    except torch.OutOfMemoryError as exc:
        _free(device)
        raise Unsupported("out of memory") from exc
    except (NotImplementedError, ValueError) as exc:
        raise Unsupported(_one_line(exc)) from exc


def prepare_attention(
    entry: Entry,
    *,
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    mode: str,
    causal: bool = True,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Prepared:
    """The timed call of an attention component on (B, H, N, D) q/k/v; raises Unsupported.

    ``fwd`` runs under ``torch.no_grad`` (inference); ``fwd+bwd`` runs the forward on inputs
    that require grad and ``torch.autograd.grad`` of q, k, v for a fixed random output grad.
    """
    _mode_factor(mode, backward=2.5)
    _check_capabilities(entry, device, causal)
    ctx = BuildContext(
        d_model=heads * head_dim,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=head_dim,
        max_seq_len=seq_len,
        n_layers=1,
    )
    module = build(entry, ctx, device, dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq_len, head_dim)
    q, k, v = (torch.randn(*shape, generator=gen).to(device=device, dtype=dtype) for _ in "qkv")
    window = getattr(module, "cache_window", None)
    window = int(window) if window else None
    flops = attention_flops(
        batch, heads, seq_len, head_dim, causal=causal, window=window, mode=mode
    )
    if mode == "fwd":

        def fwd() -> Any:
            with torch.no_grad():
                return module(q, k, v, causal=causal)

        step = _wrap(entry, fwd)
    else:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        dout = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        def fwd_bwd() -> Any:
            out = module(q, k, v, causal=causal)
            return torch.autograd.grad(out, (q, k, v), dout)

        step = _wrap(entry, fwd_bwd)
    _trial(step, device)
    info = {"batch": batch, "heads": heads, "seq_len": seq_len, "head_dim": head_dim}
    info.update(causal=causal, window=window)
    return Prepared(step, flops, None, info)


def prepare_tokens(
    entry: Entry,
    *,
    tokens: int,
    d_model: int,
    mode: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Prepared:
    """The timed call of an ffn or norm component on x of shape (1, tokens, d_model).

    ``fwd+bwd`` takes ``torch.autograd.grad`` of the input and every parameter.
    """
    kind = entry.record.kind
    _mode_factor(mode, backward=2.0)
    _check_capabilities(entry, device)
    heads = max(1, d_model // 64)
    ctx = BuildContext(
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=d_model // heads,
        max_seq_len=tokens,
        n_layers=1,
    )
    torch.manual_seed(seed)
    module = build(entry, ctx, device, dtype).train(mode == "fwd+bwd")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, d_model, generator=gen).to(device=device, dtype=dtype)
    if mode == "fwd":

        def fwd() -> Any:
            with torch.no_grad():
                out = module(x)
            _pop_side_outputs(module)
            return out

        step = _wrap(entry, fwd)
    else:
        x.requires_grad_(True)
        params = [p for p in module.parameters() if p.requires_grad]
        dout = torch.randn(1, tokens, d_model, generator=gen).to(device=device, dtype=dtype)

        def fwd_bwd() -> Any:
            out = module(x)
            _pop_side_outputs(module)
            return torch.autograd.grad(out, [x, *params], dout, allow_unused=True)

        step = _wrap(entry, fwd_bwd)
    _trial(step, device)
    flops = nbytes = None
    if kind == "norm":
        nbytes = norm_bytes(tokens, d_model, x.element_size(), mode)
    else:
        flops = ffn_flops(module, x.detach(), mode)
    return Prepared(step, flops, nbytes, {"tokens": tokens, "d_model": d_model})


# -- timing and memory ------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def time_step(
    step: Callable[[], Any],
    device: str = "cpu",
    *,
    warmup: int = 2,
    repeats: int = 5,
    min_repeat_s: float = 0.005,
    max_number: int = 1000,
) -> tuple[list[float], int]:
    """Per-call seconds of ``repeats`` repeats (and the calls per repeat) after ``warmup``
    calls; each repeat runs enough calls to last about ``min_repeat_s``."""
    for _ in range(max(1, warmup)):
        step()
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    number = max(1, min(max_number, math.ceil(min_repeat_s / one)))
    samples = []
    for _ in range(max(1, repeats)):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(number):
                step()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000 / number)
        else:
            t0 = time.perf_counter()
            for _ in range(number):
                step()
            samples.append((time.perf_counter() - t0) / number)
    return samples, number


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's C++ start/stop lines)."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        sys.stderr.flush()
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def cpu_peak_allocated(step: Callable[[], Any]) -> int:
    """Peak bytes allocated by torch's CPU allocator during one call above those live before
    it: the peak of the running sum of the allocation (+) and free (−) events the profiler
    records with ``profile_memory=True``. Frees of tensors allocated before the call are not
    reported by torch, so they cannot lower the figure."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = step()
        del out
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return int(peak)


def peak_memory(step: Callable[[], Any], device: str = "cpu") -> int:
    """Peak bytes one call allocates above what was live before it (see module docstring)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = step()
        del out
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    return cpu_peak_allocated(step)


# -- the sweep --------------------------------------------------------------------------------


def default_attention_shape(device: str, seq_len: int, head_dim: int) -> tuple[int, int]:
    """(batch, heads): 1×8 on a CPU; on a GPU B = 16384/N and H = 2048/D, so every case
    holds the same tokens × model width (the FlashAttention benchmarks' convention)."""
    if device == "cuda":
        return max(1, 16384 // seq_len), max(1, 2048 // head_dim)
    return 1, 8


def bench_kernels(
    kind: str,
    entry_list: Sequence[Entry],
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    sizes: Sequence[int] | None = None,
    head_dims: Sequence[int] = HEAD_DIMS,
    modes: Sequence[str] = MODES,
    causal: bool = True,
    batch: int | None = None,
    heads: int | None = None,
    d_model: int | None = None,
    warmup: int = 2,
    repeats: int = 5,
    min_repeat_s: float = 0.005,
    memory: bool = True,
    deadline: float | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Time every entry on every case of ``kind``: sizes are sequence lengths (attention) or
    token counts (ffn, norm). Returns one record per (entry, mode, size[, head dim]); a case an
    entry cannot run is a ``skipped`` record with the reason, an unexpected exception an
    ``error`` record. ``deadline`` (``time.monotonic()``) skips what is left after it."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    for m in modes:
        _mode_factor(m, backward=1.0)
    dtype = dtype or default_dtype(device)
    if sizes is None:
        sizes = SEQ_LENS[device] if kind == "attention" else TOKENS[device]
    d_model = d_model or D_MODEL[device]
    common = {
        "kind": kind,
        "device": device,
        "device_name": device_name(device),
        "dtype": dtype_name(dtype),
        "threads": torch.get_num_threads(),
    }
    cases: list[dict[str, Any]] = []
    for mode in modes:
        for hd in head_dims if kind == "attention" else (None,):
            for size in sizes:
                cases.append({"mode": mode, "head_dim": hd, "size": size})
    out = []
    for case in cases:
        for entry in entry_list:
            rec = _bench_one(
                kind, entry, case, common,
                device=device, dtype=dtype, causal=causal, batch=batch, heads=heads,
                d_model=d_model, warmup=warmup, repeats=repeats, min_repeat_s=min_repeat_s,
                memory=memory, deadline=deadline,
            )  # fmt: skip
            out.append(rec)
            if on_record is not None:
                on_record(rec)
    return out


def _bench_one(
    kind: str,
    entry: Entry,
    case: dict[str, Any],
    common: dict[str, Any],
    *,
    device: str,
    dtype: torch.dtype,
    causal: bool,
    batch: int | None,
    heads: int | None,
    d_model: int,
    warmup: int,
    repeats: int,
    min_repeat_s: float,
    memory: bool,
    deadline: float | None,
) -> dict[str, Any]:
    mode, size, hd = case["mode"], case["size"], case["head_dim"]
    rec: dict[str, Any] = {
        **common,
        "component": entry.label,
        "name": entry.record.name,
        "provider": getattr(entry.record, "provider", "?"),
        "options": dict(entry.options),
        "mode": mode,
    }
    if kind == "attention":
        b0, h0 = default_attention_shape(device, size, hd)
        rec.update(batch=batch or b0, heads=heads or h0, seq_len=size, head_dim=hd)
        rec.update(causal=causal, window=None)
    else:
        rec.update(tokens=size, d_model=d_model)
    rec.update(status="ok", reason=None, median_s=None, min_s=None, repeats=0, number=0)
    rec.update(flops=None, tflops=None, gbps=None, peak_memory_bytes=None)
    rec["memory_method"] = CUDA_MEMORY if device == "cuda" else CPU_MEMORY
    if deadline is not None and time.monotonic() > deadline:
        rec.update(status="skipped", reason="time budget used up")
        return rec
    prepared = None
    # The entry's context is entered once around everything, not per call (its own cost,
    # ~10-20 µs, would otherwise count against short calls).
    stack = contextlib.ExitStack()
    bare = dataclasses.replace(entry, context=None)
    try:
        if entry.context is not None:
            stack.enter_context(entry.context())
        if kind == "attention":
            prepared = prepare_attention(
                bare, batch=rec["batch"], heads=rec["heads"], seq_len=size, head_dim=hd,
                mode=mode, causal=causal, device=device, dtype=dtype,
            )  # fmt: skip
        else:
            prepared = prepare_tokens(
                bare, tokens=size, d_model=d_model, mode=mode, device=device, dtype=dtype
            )
        rec.update({k: v for k, v in prepared.info.items() if k in ("window",)})
        samples, number = time_step(
            prepared.step, device, warmup=warmup, repeats=repeats, min_repeat_s=min_repeat_s
        )
        median = statistics.median(samples)
        rec.update(median_s=median, min_s=min(samples), repeats=len(samples), number=number)
        rec["flops"] = prepared.flops
        if prepared.flops:
            rec["tflops"] = prepared.flops / median / 1e12
        if prepared.bytes_moved:
            rec["gbps"] = prepared.bytes_moved / median / 1e9
        if memory:
            rec["peak_memory_bytes"] = peak_memory(prepared.step, device)
    except Unsupported as exc:
        rec.update(status="skipped", reason=str(exc))
    except torch.OutOfMemoryError:
        rec.update(status="skipped", reason="out of memory")
    except Exception as exc:
        rec.update(status="error", reason=_one_line(exc))
    finally:
        stack.close()
        del prepared
        _free(device)
    return rec


def _case_key(rec: dict[str, Any]) -> tuple[Any, ...]:
    fields = ("kind", "device", "dtype", "mode", "batch", "heads", "seq_len", "head_dim")
    return tuple(rec.get(f) for f in (*fields, "causal", "tokens", "d_model"))


def add_ratios(records: list[dict[str, Any]], baseline: str | None) -> list[dict[str, Any]]:
    """Set ``speedup`` (baseline median / median) and ``memory_ratio`` (baseline peak /
    peak) on every ok record whose case the ``baseline`` entry also ran; None elsewhere."""
    base = {
        _case_key(r): r
        for r in records
        if baseline is not None and r["component"] == baseline and r["status"] == "ok"
    }
    for r in records:
        b = base.get(_case_key(r)) if r["status"] == "ok" else None
        r["baseline"] = baseline if b is not None else None
        r["speedup"] = b["median_s"] / r["median_s"] if b is not None else None
        mem, bmem = r.get("peak_memory_bytes"), (b or {}).get("peak_memory_bytes")
        r["memory_ratio"] = bmem / mem if b is not None and mem and bmem is not None else None
    return records


# -- output -----------------------------------------------------------------------------------


def meta(kind: str, device: str, dtype: torch.dtype, **extra: Any) -> dict[str, Any]:
    """What a JSON report says about where and how it was measured."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # pragma: no cover - triton absent
        triton_version = None
    return {
        "kind": kind,
        "device": device,
        "device_name": device_name(device),
        "dtype": dtype_name(dtype),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton_version,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "flops": {"attention": ATTENTION_FLOPS, "ffn": FFN_FLOPS}.get(kind),
        "bytes": NORM_BYTES if kind == "norm" else None,
        "memory": CUDA_MEMORY if device == "cuda" else CPU_MEMORY,
        **extra,
    }


def write_json(records: list[dict[str, Any]], path: str | Path, meta: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "records": records}, indent=2) + "\n")
    return path


def _x(rec: dict[str, Any]) -> int:
    return rec["seq_len"] if rec["kind"] == "attention" else rec["tokens"]


def plot(records: list[dict[str, Any]], path: str | Path, title: str | None = None) -> Path:
    """Median time against sequence length (tokens for ffn/norm), log-log, one line per
    component, one panel per mode (and head dim)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    ok = [r for r in records if r["status"] == "ok"]
    modes = list(dict.fromkeys(r["mode"] for r in records)) or ["fwd"]
    dims = list(dict.fromkeys(r.get("head_dim") for r in records)) or [None]
    fig = Figure(figsize=(5.2 * len(modes), 3.8 * len(dims)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(dims), len(modes), squeeze=False)
    labels = list(dict.fromkeys(r["component"] for r in records))
    kind = records[0]["kind"] if records else ""
    for i, hd in enumerate(dims):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            for label in labels:
                pts = sorted(
                    (_x(r), r["median_s"] * 1e3)
                    for r in ok
                    if r["component"] == label and r["mode"] == mode and r.get("head_dim") == hd
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ticks = sorted({_x(r) for r in records if r["mode"] == mode})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel("sequence length" if kind == "attention" else "tokens")
            ax.set_ylabel("median time (ms)")
            ax.set_title(mode + (f", head dim {hd}" if hd else ""))
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
    if title is None and records:
        r = records[0]
        title = f"{kind} on {r['device_name']} ({r['device']}, {r['dtype']})"
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _mem(n: float | None) -> str:
    if n is None:
        return "-"
    for suffix in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {suffix}"
        n /= 1024
    return f"{n:.1f} TiB"


def _time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 0.1 else f"{s * 1e3:,.1f} ms"


def _ratio(x: float | None) -> str:
    """A baseline/this ratio: > 1 means faster (smaller)."""
    return "-" if x is None else f"{x:.2f}×"


def table_rows(
    records: list[dict[str, Any]], baseline: str | None = None
) -> tuple[list[str], list[list[str]], list[str]]:
    """(headers, rows, notes) of the comparison table: ok records sorted by case, then
    one note per (component, reason) skipped or failed."""
    kind = records[0]["kind"] if records else "attention"
    on_gpu = any(r["device"] == "cuda" for r in records)
    has_base = any(r.get("speedup") is not None for r in records)
    headers = ["component", "mode"]
    headers += ["D", "N"] if kind == "attention" else ["tokens"]
    rate, scale = ("GB/s", 1.0) if kind == "norm" else ("GFLOP/s", 1e3)
    if on_gpu and kind != "norm":
        rate, scale = "TFLOP/s", 1.0
    headers += ["median", rate, "peak mem"]
    if has_base:
        headers += [f"speed vs {baseline}", f"mem vs {baseline}"]
    ok = [r for r in records if r["status"] == "ok"]
    order = {m: i for i, m in enumerate(MODES)}
    labels = {lab: i for i, lab in enumerate(dict.fromkeys(r["component"] for r in records))}
    ok.sort(
        key=lambda r: (
            order.get(r["mode"], 9),
            r.get("head_dim") or 0,
            _x(r),
            labels[r["component"]],
        )
    )
    rows = []
    for r in ok:
        row = [r["component"], r["mode"]]
        row += [str(r["head_dim"]), str(r["seq_len"])] if kind == "attention" else [str(_x(r))]
        speed = r["gbps"] if kind == "norm" else r["tflops"]
        row += [_time(r["median_s"]), "-" if speed is None else f"{speed * scale:,.1f}"]
        row.append(_mem(r.get("peak_memory_bytes")))
        if has_base:
            row += [_ratio(r.get("speedup")), _ratio(r.get("memory_ratio"))]
        rows.append(row)
    notes = []
    for r in records:
        if r["status"] != "ok":
            note = f"{r['component']}: {r['status']} ({r['reason']})"
            if note not in notes:
                notes.append(note)
    return headers, rows, notes


def rich_table(records: list[dict[str, Any]], baseline: str | None = None) -> Any:
    from rich.table import Table

    headers, rows, _ = table_rows(records, baseline)
    table = Table(box=None, pad_edge=False)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < 2 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def markdown_table(records: list[dict[str, Any]], baseline: str | None = None) -> str:
    headers, rows, notes = table_rows(records, baseline)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if notes:
        lines.append("")
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def pivot_markdown(
    records: list[dict[str, Any]], baseline: str | None = None, metric: str | None = None
) -> str:
    """One row per case (mode, head dim, size), one column per component with ``metric``
    (default TFLOP/s, GB/s for norms), then each component's speed against ``baseline``
    (baseline time / its time, > 1 = faster)."""
    if not records:
        return "(no records)\n"
    kind = records[0]["kind"]
    metric = metric or ("gbps" if kind == "norm" else "tflops")
    unit = {"gbps": "GB/s", "tflops": "TFLOP/s", "median_s": "ms"}.get(metric, metric)
    labels = list(dict.fromkeys(r["component"] for r in records))
    others = [lab for lab in labels if lab != baseline and baseline in labels]
    cases = list(dict.fromkeys((r["mode"], r.get("head_dim"), _x(r)) for r in records))
    got = {(r["mode"], r.get("head_dim"), _x(r), r["component"]): r for r in records}
    head = ["mode"] + (["D", "N"] if kind == "attention" else ["tokens"])
    head += [f"{lab} {unit}" for lab in labels] + [f"{lab} / {baseline}" for lab in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, hd, size in cases:
        row = [mode] + ([str(hd), str(size)] if kind == "attention" else [str(size)])
        for lab in labels:
            r = got.get((mode, hd, size, lab))
            if r is None or r["status"] != "ok" or r.get(metric) is None:
                row.append(r["status"] if r is not None else "-")
            else:
                value = r[metric] * (1e3 if metric == "median_s" else 1.0)
                row.append(f"{value:.3g}" if value < 100 else f"{value:,.0f}")
        for lab in others:
            r = got.get((mode, hd, size, lab))
            row.append(_ratio(r.get("speedup")) if r is not None else "-")
        lines.append("| " + " | ".join(row) + " |")
    _, _, notes = table_rows(records, baseline)
    if notes:
        lines.append("")
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


# -- the command line (``llmkit bench kernels``) ----------------------------------------------


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    from llmkit.errors import LlmkitError

    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise LlmkitError(f"{flag}: expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise LlmkitError(f"{flag}: expected positive integers, got {text!r}")
    return values


def _parse_options(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``NAME.KEY=VALUE`` items (VALUE as JSON, else a string) → {name: {key: value}}."""
    from llmkit.errors import LlmkitError

    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        target, eq, raw = item.partition("=")
        name, dot, key = target.partition(".")
        if not eq or not dot or not name or not key:
            raise LlmkitError(f"--option: expected NAME.KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(name, {})[key] = value
    return out


def run_cli(args: Any) -> int:
    """``llmkit bench kernels``: print the table, write JSON and PNG under ``--out``."""
    from llmkit.errors import LlmkitError

    kind = args.kind
    if kind not in KINDS:
        raise LlmkitError(f"--kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise LlmkitError(f"--device: expected cpu, cuda or auto, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise LlmkitError("--device cuda: no CUDA GPU is available")
    try:
        dtype = parse_dtype(args.dtype, device) if args.dtype else default_dtype(device)
    except ValueError as exc:
        raise LlmkitError(f"--dtype: {exc}") from exc
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or any(m not in MODES for m in modes):
        raise LlmkitError(f"--modes: expected fwd, fwd+bwd or both, got {args.modes!r}")
    sizes = _ints(args.seq_lens, "--seq-lens")
    head_dims = _ints(args.head_dims, "--head-dims")
    if args.repeats < 1 or args.warmup < 0:
        raise LlmkitError("--repeats must be ≥ 1 and --warmup ≥ 0")
    for flag, value in (
        ("--batch", args.batch),
        ("--heads", args.heads),
        ("--d-model", args.d_model),
    ):
        if value is not None and value < 1:
            raise LlmkitError(f"{flag}: expected a positive integer, got {value}")
    names = [n.strip() for n in (args.components or "").split(",") if n.strip()] or None
    options = _parse_options(args.option)
    entry_list = entries(kind, names, options)
    unknown = sorted(set(options) - {e.record.name for e in entry_list})
    if unknown:
        raise LlmkitError(f"--option: no {kind} component {unknown[0]!r} in this benchmark")
    if not entry_list:
        raise LlmkitError(f"no registered {kind} components")
    for e in entry_list:  # options the user gave must validate (defaults may skip a case)
        if e.label in options:
            try:
                e.record.parse_options(e.options)
            except Exception as exc:
                raise LlmkitError(f"--option {e.label}: {_option_problems(exc)}") from exc
    baseline = args.baseline if args.baseline is not None else BASELINES.get(kind)
    if args.baseline is not None and baseline not in {e.label for e in entry_list}:
        raise LlmkitError(
            f"--baseline {baseline!r} is not among the benchmarked {kind} components "
            f"({', '.join(e.label for e in entry_list)})"
        )
    if args.quick:
        sizes = sizes or (QUICK["seq_lens"] if kind == "attention" else QUICK["tokens"])
        head_dims = head_dims or QUICK["head_dims"]
        d_model = args.d_model or QUICK["d_model"]
        warmup, repeats, min_repeat_s = 1, min(args.repeats, 3), 0.002
    else:
        d_model = args.d_model
        warmup, repeats, min_repeat_s = args.warmup, args.repeats, 0.005
    before = torch.get_num_threads()
    threads = args.threads or (1 if args.quick else before)  # tiny ops: threads only wait

    progress = None
    if sys.stderr.isatty():

        def progress(r: dict[str, Any]) -> None:
            size = r.get("seq_len") or r.get("tokens")
            dim = f" D={r['head_dim']}" if r.get("head_dim") else ""
            what = _time(r["median_s"]) if r["status"] == "ok" else r["status"]
            print(f"  {r['component']} {r['mode']} {size}{dim}: {what}", file=sys.stderr)

    torch.set_num_threads(threads)
    try:
        records = bench_kernels(
            kind, entry_list, device=device, dtype=dtype, sizes=sizes,
            head_dims=head_dims or HEAD_DIMS, modes=modes, causal=args.causal,
            batch=args.batch, heads=args.heads, d_model=d_model, warmup=warmup,
            repeats=repeats, min_repeat_s=min_repeat_s, on_record=progress,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    add_ratios(records, baseline)
    from rich.console import Console

    con = Console(highlight=False, soft_wrap=True)
    if not con.is_terminal:
        con.width = max(con.width, 160)
    shape = ""
    if kind == "attention":
        bh = sorted({(r["batch"], r["heads"]) for r in records})
        shape = ", causal" if args.causal else ", non-causal"
        shape += f", B={bh[0][0]} H={bh[0][1]}" if len(bh) == 1 else ", B·H by N and D"
    elif records:
        shape = f", width {records[0]['d_model']}"
    con.print(
        f"{kind} kernels on {device_name(device)} ({device}, {dtype_name(dtype)}, "
        f"{threads} thread{'s' if threads != 1 else ''}{shape}); median of {repeats} repeats",
        markup=False,
    )
    con.print(rich_table(records, baseline))
    _, _, notes = table_rows(records, baseline)
    for note in notes:
        con.print(note, markup=False)
    out = Path(args.out)
    stem = f"kernels-{kind}-{device}"
    info = meta(kind, device, dtype, baseline=baseline, quick=args.quick, threads=threads)
    json_path = write_json(records, out / f"{stem}.json", info)
    png_path = plot(records, out / f"{stem}.png")
    con.print(f"wrote {json_path} and {png_path}", markup=False)
    return 1 if any(r["status"] == "error" for r in records) else 0
