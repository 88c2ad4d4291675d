"""GPU check of the Triton kernels: correctness in bf16, then speed against PyTorch SDPA.

Run on a machine with a CUDA GPU (``bash benchmarks/scripts/gpu_check.sh [OUT]``, or
``python -m benchmarks.scripts.gpu_check --out OUT`` from the repository root). Components are
resolved by name through the registry, so the real components run, Triton paths included.

1. Correctness, the way flash-attention tests it: every kernel runs in bf16 on the GPU and is
   compared with an fp32 reference computed from the same (bf16-rounded) inputs; it passes
   when its largest error is at most 2× that of a plain PyTorch computation in bf16 (plus
   1e-4). Forward output and every gradient (dq, dk, dv; dx and each parameter) are checked.

   - attention (``flash``, ``sliding_window``): reference
     :func:`llmkit.testing.reference_attention` in fp32 (with the kernel's ``cache_window``
     as window); plain = the same softmax attention computed in bf16. Batch 2, 4 query heads
     (2 kv heads when the component declares ``gqa``), N = 257 and 1024, D = 64 and 128,
     causal and (unless ``causal_only``) non-causal. Backward determinism (bit-identical
     gradients on a rerun) is reported, not required.
   - ffn / norm (``swiglu_triton``, ``rmsnorm_triton``): reference = a copy of the module
     in fp32 on the CPU (the plain PyTorch path, per :mod:`llmkit.kernels.runtime`); plain =
     a copy in bf16 on the CPU. Parameters are perturbed from their initial values first.

2. Speed, most wanted first (:func:`bench_plan`; a time budget cuts the rest): attention
   forward+backward, causal, bf16, N = 1k…16k, D = 64 and 128, B = 16384/N and H = 2048/D
   (constant tokens × width), ``flash`` against the ``sdpa`` component forced to its flash
   backend (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``); the Triton norm against PyTorch's
   at 4k…64k tokens of width 4096; ``sliding_window`` at W = 256, 512 and 1024 at N = 4k and
   16k (its TFLOP/s on attended pairs next to flash's at the same N, and the ratio); then the
   same forwards, and the Triton ffn against PyTorch's at 4k and 16k tokens. TFLOP/s by the
   formulas of :mod:`llmkit.bench.kernels`.

Writes ``gpu_check.md`` (the tables), ``gpu_check.json`` (every record) and PNG plots
(``--plots``: the kinds to draw, default all) under ``--out``; the first two are rewritten
after every check and every benchmark case, so a run killed at any point keeps what it
measured. Exit status: 0 all good; 1 a check failed, a component is missing or a benchmark
errored; 2 no CUDA GPU (or ``TRITON_INTERPRET`` set); 3 a kernel broke the CUDA context (an
illegal memory access makes every later CUDA call fail): ``gpu_run.py`` then reruns with
``--resume``, which skips what is done and the component that broke (reported), in a fresh
process. A time budget (``--budget``, default 420 s from the first attempt's start, checks
included; ``gpu_run.py`` gives it its stage's time) skips the benchmark cases left when it
runs out. Triton compile time is paid in each case's warm-up, not timed.

``--dry-run`` runs everything on the CPU at tiny shapes, in seconds: it checks this script's
logic (``tests/bench/test_bench_kernels.py`` runs it) but no Triton kernel, since on a CPU every
component takes its PyTorch reference path.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmkit.bench import kernels as bk
from llmkit.contracts import BuildContext

CHECKS = ("attention.flash", "attention.sliding_window", "norm.rmsnorm_triton", "ffn.swiglu_triton")
FLASH = "flash"
WINDOWED = "sliding_window"
#: (kind, component, its PyTorch counterpart) timed against each other.
TOKEN_BENCH = (("norm", "rmsnorm_triton", "rmsnorm"), ("ffn", "swiglu_triton", "swiglu"))
BASELINE = {kind: counterpart for kind, _, counterpart in TOKEN_BENCH}
SDPA_FLASH = "sdpa-flash"
#: What ``--plots`` draws by default (one PNG per kind; gpu_run.py asks for attention only).
PLOT_KINDS = ("attention", "norm", "ffn")

GPU = {
    "seq_lens": (1024, 2048, 4096, 8192, 16384),
    "head_dims": (64, 128),
    "windows": (256, 512, 1024),  # sliding_window's W, each against flash at the same N
    "window_seq_lens": (4096, 16384),
    "check_lens": (257, 1024),
    "tokens": (4096, 16384, 65536),
    "ffn_tokens": (4096, 16384),
    "d_model": 4096,
    "check_width": {"norm": 1024, "ffn": 512},
    "check_tokens": 129,
    "warmup": 2,
    "repeats": 7,
    "min_repeat_s": 0.01,
}
DRY = {
    "seq_lens": (64, 128),
    "head_dims": (16,),
    "windows": (16, 32),
    "window_seq_lens": (128,),
    "check_lens": (33, 64),
    "tokens": (64, 128),
    "ffn_tokens": (64,),
    "d_model": 64,
    "check_width": {"norm": 64, "ffn": 64},
    "check_tokens": 17,
    "warmup": 1,
    "repeats": 2,
    "min_repeat_s": 0.0,
}


class SetupError(Exception):
    """The machine cannot run the check (no GPU, interpreter on)."""


@dataclass
class Check:
    component: str
    case: str
    quantity: str
    error: float
    plain_error: float
    tolerance: float
    ok: bool
    note: str = ""


class CudaLost(Exception):
    """A kernel left the CUDA context unusable (e.g. an illegal memory access): every later
    CUDA call in this process would fail too."""


#: Exit status asking gpu_check.sh to resume in a fresh process (see :class:`State`).
EXIT_RESUME = 3


def cuda_alive(device: str) -> bool:
    """False when the CUDA context is broken (errors from a faulted kernel are sticky)."""
    if device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:
        return False


class State:
    """Everything measured so far, rewritten to ``gpu_check.json`` / ``gpu_check.md`` after
    every check and every benchmark case, so a run killed at any point keeps its results.

    Resuming (``--resume``, what gpu_check.sh does after exit status 3 or a crash) reloads
    that file, skips the units already done and marks the component whose unit was running
    when the process died as broken: its remaining checks and cases are skipped with the
    reason, the other components still run.
    """

    def __init__(self, out: Path, env: dict[str, Any], device: str, resume: bool = False) -> None:
        self.out = out
        self.env = env
        self.device = device
        self.checks: list[Check] = []
        self.missing: list[str] = []
        self.benches: dict[str, list[dict]] = {}
        self.done: set[str] = set()
        self.broken: dict[str, str] = {}  # component name → why it is skipped from now on
        self.running: dict[str, Any] | None = None
        self.started = time.time()
        self.attempts = 1
        path = out / "gpu_check.json"
        if resume and path.exists():
            data = json.loads(path.read_text())
            st = data.get("state", {})
            self.checks = [Check(**c) for c in data.get("checks", [])]
            self.missing = list(data.get("missing", []))
            self.benches = dict(data.get("benchmarks", {}))
            self.done = set(st.get("done", []))
            self.broken = dict(st.get("broken", {}))
            self.started = float(st.get("started", self.started))
            self.attempts = int(st.get("attempts", 0)) + 1
            died = st.get("running")
            if died:  # the previous process died inside this unit (crash, kill)
                self.finish(died, lost=True, reason="the process died while running it")

    def begin(self, unit: dict[str, Any]) -> None:
        self.running = unit
        self.save()

    def stub_record(self, unit: dict[str, Any], status: str, reason: str) -> dict[str, Any]:
        """A benchmark record for a case that did not run (what the tables need)."""
        rec = {"kind": unit["kind"], "device": self.device, "device_name": self.env.get("device"),
               "dtype": self.env.get("dtype"), "component": unit["label"], "name": unit["name"],
               "mode": unit["mode"], "status": status, "reason": reason, "median_s": None,
               "tflops": None, "gbps": None, "peak_memory_bytes": None}  # fmt: skip
        if unit["kind"] == "attention":
            rec.update(seq_len=unit["size"], head_dim=unit["head_dim"], causal=True)
        else:
            rec.update(tokens=unit["size"], head_dim=None)
        return rec

    def finish(
        self,
        unit: dict[str, Any],
        *,
        checks: list[Check] | None = None,
        bench: dict[str, Any] | None = None,
        lost: bool = False,
        reason: str | None = None,
    ) -> None:
        """Record a unit's results; ``lost``: it broke the CUDA context (or the process)."""
        if lost:
            why = reason or "CUDA context lost"
            what = unit["key"].split(":", 1)[1]
            self.broken.setdefault(unit["name"], f"{why} in {what}")
            if unit["what"] == "check" and not checks:
                checks = [Check(unit["name"], "-", "run", math.nan, math.nan, 0.0, False, why)]
            if unit["what"] == "bench" and bench is None:
                bench = self.stub_record(unit, "error", why)
        self.checks += checks or []
        if bench is not None:
            self.benches.setdefault(unit["kind"], []).append(bench)
        self.done.add(unit["key"])
        self.running = None
        self.save()

    def save(self) -> None:
        for kind, records in self.benches.items():
            bk.add_ratios(records, SDPA_FLASH if kind == "attention" else BASELINE[kind])
        (self.out / "gpu_check.md").write_text(
            report(self.env, self.checks, self.missing, self.benches, self.broken)
        )
        state = {"done": sorted(self.done), "broken": self.broken, "running": self.running,
                 "started": self.started, "attempts": self.attempts}  # fmt: skip
        payload = {"environment": self.env, "checks": [asdict(c) for c in self.checks],
                   "missing": self.missing, "benchmarks": self.benches, "state": state}  # fmt: skip
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        tmp.replace(self.out / "gpu_check.json")


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _err(a: Tensor, b: Tensor) -> float:
    return (a.detach().float().cpu() - b.detach().float().cpu()).abs().max().item()


def _compare(component: str, case: str, pairs: dict[str, tuple[Tensor, Tensor, Tensor]]) -> list:
    """pairs: quantity → (kernel value, plain value, fp32 reference)."""
    out = []
    for quantity, (got, plain, ref) in pairs.items():
        if got is None or ref is None:
            note = "no gradient" if got is None else "no reference gradient"
            out.append(Check(component, case, quantity, math.nan, math.nan, 0.0, False, note))
            continue
        err, perr = _err(got, ref), _err(plain, ref)
        tol = 2 * perr + 1e-4
        finite = bool(torch.isfinite(got).all())
        ok = finite and err <= tol
        out.append(Check(component, case, quantity, err, perr, tol, ok, "" if finite else "nan"))
    return out


def plain_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int | None) -> Tensor:
    """Softmax attention computed entirely in the inputs' dtype (what a plain PyTorch model in
    bf16 computes); bottom-right aligned, GQA by repeating kv heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    tq, tk = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        qpos = torch.arange(tk - tq, tk, device=q.device)[:, None]
        kpos = torch.arange(tk, device=q.device)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _grads(fn: Any, inputs: tuple[Tensor, ...], dout: Tensor) -> tuple[Tensor, tuple]:
    """fn's output on fresh leaf copies of ``inputs``, and the gradients for ``dout``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, dout)


def attention_case(
    name: str, module: Any, qkv: tuple[Tensor, ...], dout: Tensor, causal: bool, case: str
) -> list[Check]:
    """Compare one kernel call (output, dq, dk, dv) with the fp32 reference and plain bf16."""
    from llmkit.testing import reference_attention

    window = getattr(module, "cache_window", None) if causal else None

    def kernel(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return module(q, k, v, causal=causal)

    def ref(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return reference_attention(q, k, v, causal=causal, window=window)

    def plain(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return plain_attention(q, k, v, causal, window)

    got, grads = _grads(kernel, qkv, dout)
    want, rgrads = _grads(ref, tuple(t.float() for t in qkv), dout.float())
    pl, pgrads = _grads(plain, qkv, dout)
    pairs = {"out": (got, pl, want)}
    for quantity, g, p, r in zip(("dq", "dk", "dv"), grads, pgrads, rgrads):
        pairs[quantity] = (g, p, r)
    checks = _compare(name, case, pairs)
    _, again = _grads(kernel, qkv, dout)
    same = all(torch.equal(a, b) for a, b in zip(grads, again))
    checks[-1].note = "deterministic backward" if same else "backward not bit-identical"
    return checks


def check_attention(
    record: Any, device: str, dtype: torch.dtype, lens: tuple[int, ...], dims: tuple[int, ...]
) -> list[Check]:
    caps = dict(record.capabilities or {})
    hq, hkv = 4, (2 if caps.get("gqa") else 4)
    out: list[Check] = []
    for n in lens:
        for d in dims:
            ctx = BuildContext(d_model=hq * d, n_heads=hq, n_kv_heads=hkv, head_dim=d,
                               max_seq_len=n, n_layers=1)  # fmt: skip
            module = bk.build(bk.Entry(record.name, record), ctx, device, dtype).eval()
            gen = torch.Generator().manual_seed(n * 1000 + d)
            shapes = [(2, hq, n, d), (2, hkv, n, d), (2, hkv, n, d), (2, hq, n, d)]
            q, k, v, dout = (torch.randn(*s, generator=gen).to(device, dtype) for s in shapes)
            for causal in (True, False) if not caps.get("causal_only") else (True,):
                window = getattr(module, "cache_window", None) if causal else None
                case = f"B=2 Hq={hq} Hkv={hkv} N={n} D={d} causal={causal}"
                case += f" W={window}" if window else ""
                out += attention_case(record.name, module, (q, k, v), dout, causal, case)
    return out


def check_module(record: Any, device: str, dtype: torch.dtype, width: int, tokens: int) -> list:
    """ffn / norm: the module in ``dtype`` on ``device`` against an fp32 and a same-dtype copy
    on the CPU (the plain PyTorch path)."""
    heads = max(1, width // 64)
    ctx = BuildContext(d_model=width, n_heads=heads, n_kv_heads=heads, head_dim=width // heads,
                       max_seq_len=tokens, n_layers=1)  # fmt: skip
    torch.manual_seed(0)
    base = bk.build(bk.Entry(record.name, record), ctx, "cpu", torch.float32)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.1 * torch.randn_like(p))
    kernel = copy.deepcopy(base).to(device=device, dtype=dtype)
    plain = copy.deepcopy(base).to(dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, tokens, width, generator=gen).to(dtype)
    dout = torch.randn(2, tokens, width, generator=gen).to(dtype)

    def run(module: torch.nn.Module, dev: str, cast: Any) -> tuple[Tensor, list]:
        xl = cast(x).to(dev).detach().requires_grad_(True)
        params = [p for _, p in module.named_parameters()]
        o = module(xl)
        grads = torch.autograd.grad(o, [xl, *params], cast(dout).to(dev), allow_unused=True)
        return o, list(grads)

    got, grads = run(kernel, device, lambda t: t)
    ref, rgrads = run(base, "cpu", lambda t: t.float())
    pl, pgrads = run(plain, "cpu", lambda t: t)
    names = ["dx"] + [f"d{name}" for name, _ in base.named_parameters()]
    pairs = {"out": (got, pl, ref)}
    for name, g, p, r in zip(names, grads, pgrads, rgrads):
        pairs[name] = (g, p, r)
    return _compare(record.name, f"x 2×{tokens}×{width}", pairs)


# -- benchmarks -------------------------------------------------------------------------------


def sdpa_flash_context() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def attention_entries(reg: Any) -> list[bk.Entry]:
    """flash (if registered) and SDPA forced to its flash backend."""
    entries = [_entry(reg, FLASH)] if FLASH in reg.names("attention") else []
    entries.append(bk.Entry(SDPA_FLASH, reg.get("attention", "sdpa"), context=sdpa_flash_context))
    return entries


def window_label(window: int) -> str:
    return f"window-{window}"


def window_entries(reg: Any, windows: tuple[int, ...]) -> list[bk.Entry]:
    """sliding_window at each window W (labelled ``window-W``), if registered."""
    if WINDOWED not in reg.names("attention"):
        return []
    record = reg.get("attention", WINDOWED)
    return [bk.Entry(window_label(w), record, {"window": w}) for w in windows]


def _entry(reg: Any, name: str, kind: str = "attention") -> bk.Entry:
    return bk.Entry(name, reg.get(kind, name))


def bench_plan(reg: Any, cfg: dict) -> list[tuple[str, list[bk.Entry], dict]]:
    """(kind, entries, sweep) groups in the order they run, most wanted first, so a time
    budget cuts the least wanted: flash vs SDPA-flash forward+backward (every N and D), the
    norm forward+backward, the sliding windows forward+backward (flash at the same N is in
    the first group), then the forwards, then the ffn."""
    attn = {"sizes": cfg["seq_lens"], "head_dims": cfg["head_dims"]}
    win = {"sizes": cfg["window_seq_lens"], "head_dims": cfg["head_dims"]}
    token_entries = {}
    for kind, name, counterpart in TOKEN_BENCH:
        names = [n for n in (name, counterpart) if n in reg.names(kind)]
        token_entries[kind] = [_entry(reg, n, kind) for n in names]
    norm = {"sizes": cfg["tokens"], "head_dims": (None,)}
    ffn = {"sizes": cfg["ffn_tokens"], "head_dims": (None,)}
    attention, windows = attention_entries(reg), window_entries(reg, cfg["windows"])
    plan = [
        ("attention", attention, {**attn, "modes": ("fwd+bwd",)}),
        ("norm", token_entries["norm"], {**norm, "modes": ("fwd+bwd",)}),
        ("attention", windows, {**win, "modes": ("fwd+bwd",)}),
        ("attention", attention, {**attn, "modes": ("fwd",)}),
        ("attention", windows, {**win, "modes": ("fwd",)}),
        ("norm", token_entries["norm"], {**norm, "modes": ("fwd",)}),
        ("ffn", token_entries["ffn"], {**ffn, "modes": ("fwd+bwd", "fwd")}),
    ]
    return [group for group in plan if group[1]]


def _bench_key(kind: str, label: str, mode: str, head_dim: int | None, size: int) -> str:
    return f"bench:{kind}:{label}:{mode}:{head_dim}:{size}"


def run_benchmarks(state: State, reg: Any, device: str, cfg: dict, deadline: float) -> None:
    """One case at a time (all entries of a case together, so a budget cut leaves whole
    comparisons), each record saved as it lands. A case whose call kills the CUDA context
    raises CudaLost (the wrapper resumes in a fresh process; that component is then skipped)."""
    for kind, entries, sweep in bench_plan(reg, cfg):
        for mode in sweep["modes"]:
            for hd in sweep["head_dims"]:
                for size in sweep["sizes"]:
                    for entry in entries:
                        key = _bench_key(kind, entry.label, mode, hd, size)
                        if key in state.done:
                            continue
                        unit = {"key": key, "what": "bench", "kind": kind, "label": entry.label,
                                "name": entry.record.name, "mode": mode, "head_dim": hd,
                                "size": size}  # fmt: skip
                        broken = state.broken.get(entry.record.name)
                        if broken is not None:
                            rec = state.stub_record(unit, "skipped", f"not run: {broken}")
                            state.finish(unit, bench=rec)
                            _progress(rec)
                            continue
                        state.begin(unit)
                        extra = {"d_model": cfg["d_model"]} if kind != "attention" else {}
                        rec = bk.bench_kernels(
                            kind, [entry], device=device, dtype=cfg["dtype"], sizes=[size],
                            head_dims=[hd], modes=[mode], warmup=cfg["warmup"],
                            repeats=cfg["repeats"], min_repeat_s=cfg["min_repeat_s"],
                            deadline=deadline, **extra,
                        )[0]  # fmt: skip
                        _progress(rec)
                        lost = rec["status"] == "error" and not cuda_alive(device)
                        state.finish(unit, bench=rec, lost=lost)
                        if lost:
                            raise CudaLost(f"{entry.label} {mode} N={size} D={hd}: {rec['reason']}")


def _progress(r: dict) -> None:
    size = r.get("seq_len") or r.get("tokens")
    dim = f" D={r['head_dim']}" if r.get("head_dim") else ""
    if r["status"] == "ok":
        rate = f"{r['tflops']:.3g} TFLOP/s" if r.get("tflops") else f"{r['gbps']:.3g} GB/s"
        what = f"{r['median_s'] * 1e3:.3f} ms, {rate}"
    else:
        what = f"{r['status']}: {r['reason']}"
    print(f"  {r['component']:>15} {r['mode']:<7} {size:>6}{dim}: {what}", flush=True)


# -- report -----------------------------------------------------------------------------------


def environment(device: str) -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    from llmkit.kernels import runtime

    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": bk.device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "kernel path": runtime.backend(device),
    }


def checks_markdown(checks: list[Check]) -> str:
    lines = [
        "| component | case | quantity | max error | plain bf16 error | tolerance | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        result = "ok" if c.ok else "**FAIL**"
        if c.note:
            result += f" ({c.note})"
        lines.append(
            f"| {c.component} | {c.case} | {c.quantity} | {c.error:.3g} | {c.plain_error:.3g} "
            f"| {c.tolerance:.3g} | {result} |"
        )
    return "\n".join(lines) + "\n"


def window_markdown(records: list[dict]) -> str:
    """One row per (mode, D, N) the windows ran at: flash's TFLOP/s, then each window's
    TFLOP/s on its attended pairs and its ratio to flash's (> 1: more useful work per
    second than flash on the full causal triangle), and its time against flash's."""
    ok = {(r["component"], r["mode"], r["head_dim"], r["seq_len"]): r
          for r in records if r["status"] == "ok"}  # fmt: skip
    labels = list(dict.fromkeys(r["component"] for r in records
                                if r["component"].startswith("window-")))  # fmt: skip
    cases = list(dict.fromkeys((r["mode"], r["head_dim"], r["seq_len"]) for r in records
                               if r["component"] in labels))  # fmt: skip
    if not cases:
        return "(no records)\n"
    head = ["mode", "D", "N", f"{FLASH} TFLOP/s"]
    for lab in labels:
        w = lab.removeprefix("window-")
        head += [f"W={w} TFLOP/s", f"W={w} / {FLASH} TFLOP/s", f"W={w} time vs {FLASH}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(x: float | None) -> str:
        return "-" if x is None else (f"{x:.3g}" if x < 100 else f"{x:,.0f}")

    for mode, d, n in cases:
        flash = ok.get((FLASH, mode, d, n))
        row = [mode, str(d), str(n), fmt(flash and flash["tflops"])]
        for lab in labels:
            r = ok.get((lab, mode, d, n))
            if r is None:
                status = next((x["status"] for x in records if (x["component"], x["mode"],
                               x["head_dim"], x["seq_len"]) == (lab, mode, d, n)), "-")  # fmt: skip
                row += [status, "-", "-"]
                continue
            both = flash is not None and r["tflops"] and flash["tflops"]
            row += [fmt(r["tflops"]), f"{r['tflops'] / flash['tflops']:.2f}×" if both else "-",
                    f"{flash['median_s'] / r['median_s']:.2f}×" if both else "-"]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def report(
    env: dict,
    checks: list[Check],
    missing: list[str],
    benches: dict,
    broken: dict[str, str] | None = None,
) -> str:
    parts = ["# GPU check of the Triton kernels\n"]
    parts.append("\n".join(f"- {k}: {v}" for k, v in env.items()) + "\n")
    if broken:
        parts.append(
            "**Broke the CUDA context or the process** (their remaining checks and cases "
            "were skipped):\n\n" + "\n".join(f"- {k}: {v}" for k, v in broken.items()) + "\n"
        )
    parts.append(f"## Correctness ({env['dtype']} vs fp32 reference; ≤ 2× plain error)\n")
    if missing:
        parts.append("Missing (not registered): " + ", ".join(missing) + "\n")
    failed = [c for c in checks if not c.ok]
    parts.append(f"{len(checks) - len(failed)} of {len(checks)} comparisons pass.\n")
    parts.append(checks_markdown(checks))
    attention = benches.get("attention") or []
    full = [r for r in attention if not r["component"].startswith("window-")]
    windows = [r for r in attention if r["component"].startswith("window-")]
    if full:
        parts.append(
            "## Attention speed (causal; B = 16384/N, H = 2048/D)\n\n"
            f"TFLOP/s: {bk.ATTENTION_FLOPS}. `{SDPA_FLASH}` is the `sdpa` component under "
            "`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`; the ratio columns are its time over "
            "each kernel's (> 1 = faster than SDPA-flash). Triton compile time is excluded "
            "(warm-up calls).\n"
        )
        parts.append(bk.pivot_markdown(full, SDPA_FLASH))
    if windows:
        parts.append(
            f"## Sliding window against {FLASH} (causal; B = 16384/N, H = 2048/D)\n\n"
            "`window-W` is `sliding_window` with window W; its TFLOP/s count only the attended "
            "pairs (N·W − W²/2), flash's the causal triangle (N²/2). The TFLOP/s ratio says how "
            "close the band kernel runs to flash's rate; the time ratio is flash's time over "
            "the window's (> 1 = the window is faster).\n"
        )
        parts.append(window_markdown(attention))
    if attention:
        parts.append("Attention peak memory and times:\n")
        parts.append(bk.markdown_table(attention, SDPA_FLASH))
    for kind in ("norm", "ffn"):
        if benches.get(kind):
            base = BASELINE.get(kind)
            width = next((r.get("d_model") for r in benches[kind] if r.get("d_model")), "?")
            parts.append(f"## {kind} speed (width {width})\n")
            parts.append(bk.pivot_markdown(benches[kind], base))
            parts.append(bk.markdown_table(benches[kind], base))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check", help="directory")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: logic only")
    parser.add_argument("--dtype", default="bfloat16", help="kernel dtype (default bfloat16)")
    parser.add_argument("--components", help=f"kind.name list to check (default {CHECKS})")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for benchmarks")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument(
        "--plots", default=",".join(PLOT_KINDS), help="kinds to plot (comma list, or none)"
    )
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument(
        "--resume", action="store_true", help="continue the run recorded in OUT/gpu_check.json"
    )
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if args.dry_run:
        torch.set_num_threads(1)  # tiny shapes: threads only wait on each other
    try:
        return run(args)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    if args.dry_run:
        device, cfg = "cpu", dict(DRY)
    else:
        if not torch.cuda.is_available():
            raise SetupError(
                "gpu_check needs a CUDA GPU (torch.cuda.is_available() is False); "
                "--dry-run runs its logic on the CPU"
            )
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            raise SetupError("TRITON_INTERPRET is set: unset it to run the compiled kernels")
        device, cfg = "cuda", dict(GPU)
    try:
        cfg["dtype"] = bk.parse_dtype(args.dtype, device)
    except ValueError as exc:
        raise SetupError(str(exc)) from exc
    from llmkit.registry import get_registry

    reg = get_registry()
    env = {**environment(device), "dtype": bk.dtype_name(cfg["dtype"])}
    print("\n".join(f"{k}: {v}" for k, v in env.items()), flush=True)
    wanted = [c.strip() for c in (args.components or ",".join(CHECKS)).split(",") if c.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = State(out, env, device, resume=args.resume)
    if state.attempts > 1:
        print(f"resuming (attempt {state.attempts}); broken: {state.broken or 'none'}")
    state.save()
    # The fp32 references must be fp32, not TF32 (the kernels' own fp32 paths are not tested).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        if not args.skip_checks:
            run_checks(state, reg, wanted, device, cfg)
        if not args.skip_bench:
            # The budget counts from the first attempt's start (a resumed run has less left).
            spent = max(0.0, time.time() - state.started - (time.monotonic() - t0))
            run_benchmarks(state, reg, device, cfg, deadline=t0 + args.budget - spent)
    except CudaLost as exc:
        print(f"CUDA context lost ({exc}); exit {EXIT_RESUME}: resume in a fresh process")
        return EXIT_RESUME
    plots = [k.strip() for k in args.plots.split(",") if k.strip() and k.strip() != "none"]
    for kind, records in state.benches.items():
        if kind not in plots:
            continue
        try:
            bk.plot(records, out / f"gpu_check_{kind}.png")
        except Exception as exc:  # matplotlib missing: the tables are what matters
            print(f"note: no plot for {kind}: {_one_line(exc)}")
    benches, checks = state.benches, state.checks
    errors = [r for rs in benches.values() for r in rs if r["status"] == "error"]
    failed = [c for c in checks if not c.ok]
    print(f"wrote {out / 'gpu_check.md'} ({time.monotonic() - t0:.0f} s)")
    if failed or state.missing or errors:
        print(
            f"FAILED: {len(failed)} comparisons, {len(state.missing)} missing, "
            f"{len(errors)} benchmark errors"
        )
        return 1
    return 0


def run_checks(state: State, reg: Any, wanted: list[str], device: str, cfg: dict) -> None:
    for key in wanted:
        kind, _, name = key.partition(".")
        unit = {"key": f"check:{key}", "what": "check", "kind": kind, "name": name}
        if unit["key"] in state.done:
            continue
        if kind not in reg.kinds or name not in reg.names(kind):
            state.missing.append(key)
            print(f"check {key}: MISSING (not registered)", flush=True)
            state.finish(unit)
            continue
        record = reg.get(kind, name)
        t = time.monotonic()
        state.begin(unit)
        try:
            if kind == "attention":
                got = check_attention(
                    record, device, cfg["dtype"], cfg["check_lens"], cfg["head_dims"]
                )
            else:
                width = cfg["check_width"].get(kind, 256)
                got = check_module(record, device, cfg["dtype"], width, cfg["check_tokens"])
        except Exception as exc:  # a crash is a failed check, and the rest still run
            got = [Check(name, "-", "run", math.nan, math.nan, 0.0, False, _one_line(exc))]
        lost = not cuda_alive(device)
        state.finish(unit, checks=got, lost=lost)
        bad = sum(not c.ok for c in got)
        status = "ok" if not bad else f"{bad} FAILED"
        print(f"check {key}: {len(got)} comparisons, {status} ({time.monotonic() - t:.1f} s)")
        if lost:
            raise CudaLost(f"check {key}: {got[-1].note}")


if __name__ == "__main__":
    sys.exit(main())
