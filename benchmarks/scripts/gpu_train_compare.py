"""End-to-end training speed on one GPU, side by side: ``llmkit train`` at GPT-2 small's shape
next to ``benchmarks/reference_gpt.py`` (nanoGPT's model and loop in plain PyTorch) and, when
given a checkout of it, nanoGPT's own ``train.py``.

The shape is GPT-2 small's (12 layers, width 768, 12 heads, context 1024) on the characters
of tinyshakespeare (vocabulary 65), bf16 autocast, no dropout, no biases, tied embeddings,
learned positions, a GELU MLP and LayerNorm: nanoGPT's ``config/train_shakespeare_char.py``
with the shape overridden. Each implementation trains eager and compiled (``torch.compile``),
at batch 12 and 32; llmkit with the ``flash`` (Triton) and the ``sdpa`` attention. Every run is
its own process and every iteration's time is read from its log: llmkit's ``metrics.jsonl``
(``log_interval = 1``: tokens/s of each step), the ``iter N: loss X, time Y ms`` lines of
nanoGPT and of reference_gpt. ms/iter is the median over the iterations after the first
:data:`WARMUP` (compilation, Triton's and cuBLAS's first calls), tokens/s = batch × 1024 /
that, and MFU is the same formula for all: nanoGPT's ``estimate_mfu`` (PaLM appendix B),
``(6·N + 12·L·H·Q·T)`` FLOPs per token with N the parameters without the position embedding,
against :data:`PEAK_FLOPS` (989 TFLOP/s, dense bf16 of an H100 or H200 SXM). nanoGPT prints
its own MFU against an A100's 312 TFLOP/s; its log keeps that figure.

Runs go in priority order (batch 12 eager, then compiled, then llmkit with sdpa, then batch
32) and one starts only when the time it is expected to take (the longest seen of its kind,
eager or compiled, else a default) fits what is left of the budget; a run cut by the budget
keeps the iterations it logged.

Data: llmkit's char tokenizer and token files come from the shared data cache
(``LLMKIT_CACHE_DIR`` = ``.gpucheck/cache``, keyed by the corpus's content), so the GPU
machine, which has no ``datasets``, tokenizes nothing. ``--prepare`` (here, where
``datasets`` works) copies the corpus into ``.gpucheck/data/``, fills that cache, checks in a
child without ``datasets`` that the run takes everything from it, and writes nanoGPT's
``data/shakespeare_char`` files (:mod:`benchmarks.scripts.nanogpt_data`). ``.gpucheck/`` and
nanoGPT's checkout are git-excluded: name them in the device tool's ``carry``.

    python -m benchmarks.scripts.gpu_train_compare --prepare [--nanogpt .nanogpt]
    python -m benchmarks.scripts.gpu_train_compare --out OUT [--nanogpt .nanogpt] [--budget S]

``benchmarks/scripts/gpu_run.py`` runs this as its last stage (summary.md / summary.json);
alone it writes ``e2e.md``, ``e2e.json`` and ``e2e.log`` into ``--out``. ``--dry-run``
runs the same commands on the CPU at a tiny shape, eager only, in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: The git-excluded folder carried to the device machine: the corpus and the token cache.
CARRY = ".gpucheck"
DEFAULT_CORPUS = f"{CARRY}/data/tinyshakespeare.txt"
CACHE = f"{CARRY}/cache"
#: Where the corpus is found on this workplace's machines (``--prepare`` copies it in).
SOURCES = ("../shared/data/tinyshakespeare.txt", "shared/data/tinyshakespeare.txt")
#: Dense bf16 peak of an H100 / H200 SXM (datasheet), the MFU denominator for every run.
PEAK_FLOPS = 989e12
#: nanoGPT's estimate_mfu denominator (an A100's bf16 peak), for reading its own log.
NANOGPT_PEAK = 312e12
VOCAB = 65  # tinyshakespeare's distinct characters (llmkit adds <unk>: 66, a 0.01 % change)
WARMUP = 10
STEPS = 60
BATCHES = (12, 32)
ATTENTIONS = ("flash", "sdpa")
#: Seconds a run is expected to take before one of its kind has been seen (start-up, data,
#: compile, 60 steps, the final evaluation and checkpoint).
EXPECTED_S = {False: 25.0, True: 90.0}
#: Longest any one run may take.
MAX_RUN_S = 240.0
#: Fewest timed iterations (after the warm-up) that make a figure.
MIN_TIMED = 5
ITER_RE = re.compile(r"^iter (\d+): loss (\S+), time ([\d.]+) ?ms(?:, mfu (-?[\d.]+)%)?")


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int

    def flops_per_token(self, vocab: int = VOCAB) -> float:
        """nanoGPT's ``estimate_mfu`` per token: 6·N + 12·L·H·Q·T, N = its
        ``get_num_params()`` (every parameter but the position embedding; the tied token
        embedding counts once, as the output head)."""
        d, n_layer = self.n_embd, self.n_layer
        n = n_layer * (12 * d * d + 2 * d) + d + vocab * d  # blocks (no biases), ln_f, wte
        return 6.0 * n + 12.0 * n_layer * d * self.block_size


GPT2_SMALL = Shape(12, 12, 768, 1024)
DRY_SHAPE = Shape(2, 2, 64, 64)


@dataclass(frozen=True)
class Plan:
    """One training run: an implementation, eager or compiled, a batch size."""

    impl: str  # "llmkit", "reference", "nanogpt"
    compiled: bool
    batch: int
    attention: str | None = None  # llmkit's attention component

    @property
    def key(self) -> str:
        impl = f"{self.impl}-{self.attention}" if self.attention else self.impl
        return f"{impl}:{self.mode}:b{self.batch}"

    @property
    def mode(self) -> str:
        return "compiled" if self.compiled else "eager"

    @property
    def label(self) -> str:
        if self.impl == "llmkit":
            return f"llmkit ({self.attention})"
        return {"reference": "reference_gpt", "nanogpt": "nanoGPT"}[self.impl]


def plans(
    batches: tuple[int, ...] = BATCHES,
    nanogpt: bool = True,
    compiled: bool = True,
    attentions: tuple[str, ...] = ATTENTIONS,
) -> list[Plan]:
    """Every run in priority order: for each batch, llmkit (first attention), nanoGPT and
    reference_gpt eager, llmkit with the other attentions eager, then the same compiled."""
    out: list[Plan] = []
    for b in batches:
        for comp in (False, True) if compiled else (False,):
            out.append(Plan("llmkit", comp, b, attentions[0]))
            if nanogpt:
                out.append(Plan("nanogpt", comp, b))
            out.append(Plan("reference", comp, b))
            out += [Plan("llmkit", comp, b, a) for a in attentions[1:]]
    return out


@dataclass
class Result:
    key: str
    impl: str
    label: str
    mode: str
    batch: int
    status: str = "pending"  # ok, partial, timeout, error, skipped
    reason: str = ""
    iters: int = 0  # iterations logged
    timed: int = 0  # iterations in the median (after the warm-up)
    ms_per_iter: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None  # common formula (module docstring)
    own_mfu: float | None = None  # what the implementation itself reports, if it does
    loss: float | None = None  # last logged training loss
    wall_s: float | None = None
    rc: int | None = None
    command: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# -- parsing ----------------------------------------------------------------------------------


def parse_iter_lines(text: str) -> list[tuple[int, float, float, float | None]]:
    """(iteration, loss, ms, mfu % or None) of each ``iter N: loss X, time Y ms[, mfu Z%]``
    line (nanoGPT's train.py, reference_gpt's ``--log-interval``)."""
    out = []
    for line in text.splitlines():
        m = ITER_RE.match(line.strip())
        if m:
            mfu = float(m.group(4)) if m.group(4) is not None else None
            try:
                loss = float(m.group(2))
            except ValueError:
                loss = float("nan")
            out.append((int(m.group(1)), loss, float(m.group(3)), mfu))
    return out


def parse_metrics(path: Path, tokens_per_step: int) -> list[tuple[int, float, float, float | None]]:
    """(iteration from 0, loss, ms, mfu or None) of each training record of an llmkit
    ``metrics.jsonl`` written with ``log_interval = 1`` (a line that does not parse, as a
    kill can leave the last one, is skipped)."""
    out = []
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not rec.get("tokens_per_s") or "step" not in rec:
            continue
        ms = tokens_per_step / float(rec["tokens_per_s"]) * 1e3
        loss = rec.get("loss")
        out.append((int(rec["step"]) - 1, float(loss) if loss is not None else float("nan"),
                    ms, rec.get("mfu")))  # fmt: skip
    return out


def measure(
    res: Result,
    samples: list[tuple[int, float, float, float | None]],
    tokens_per_step: int,
    flops_per_token: float,
    warmup: int = WARMUP,
    own_mfu_scale: float = 1.0,
) -> None:
    """Fill ``res``'s figures from per-iteration samples: the median ms over the iterations
    from ``warmup`` on, tokens/s and the common MFU from it, the implementation's own MFU
    (median of what it logged, times ``own_mfu_scale``)."""
    res.iters = len(samples)
    timed = [s for s in samples if s[0] >= warmup]
    res.timed = len(timed)
    if samples:
        res.loss = samples[-1][1]
    if len(timed) < MIN_TIMED:
        return
    ms = statistics.median(s[2] for s in timed)
    res.ms_per_iter = ms
    res.tokens_per_s = tokens_per_step / (ms / 1e3)
    res.mfu = flops_per_token * res.tokens_per_s / PEAK_FLOPS
    own = [s[3] for s in timed if s[3] is not None and s[3] >= 0]
    if own:
        res.own_mfu = statistics.median(own) * own_mfu_scale


# -- commands ---------------------------------------------------------------------------------


def llmkit_spec(corpus: str, shape: Shape, device: str, steps: int, batch: int) -> str:
    """The spec llmkit trains: nanoGPT's shakespeare-char recipe (specs/shakespeare-char.toml)
    at ``shape``, bf16 on CUDA, random windows as nanoGPT draws them, one evaluation batch at
    the end, a metrics line every step, no plot and no sample."""
    precision = "bf16" if device.startswith("cuda") else "fp32"
    return f"""# Written by benchmarks/scripts/gpu_train_compare.py: a throughput run, not a recipe.
name = "gpt-char-e2e"

[model]
vocab_size = {VOCAB}
d_model = {shape.n_embd}
n_layers = {shape.n_layer}
n_heads = {shape.n_head}
max_seq_len = {shape.block_size}
dropout = 0.0
bias = false
tie_embeddings = true
attention = {{ name = "flash" }}
ffn = {{ name = "mlp", activation = "gelu" }}
norm = {{ name = "layernorm" }}
position = {{ name = "learned" }}

[tokenizer]
kind = "char"
special_tokens = []

[data]
source = {{ name = "text", paths = [{json.dumps(corpus)}], val_fraction = 0.1, split = "tail" }}
sampling = "random"

[optimizer]
name = "adamw"
lr = 1e-3
betas = [0.9, 0.99]
weight_decay = 0.1
decay_embeddings = true

[schedule]
name = "cosine"
warmup_steps = {min(10, steps)}
min_lr_ratio = 0.1

[train]
batch_size = {batch}
max_steps = {steps}
precision = "{precision}"
device = "{device}"
compile = false
eval_interval = {steps}
eval_batches = 1
log_interval = 1
plot = false
sample_tokens = 0
"""


@dataclass
class Setup:
    """Where and how the runs happen."""

    python: str
    corpus: str  # relative to ROOT where inside it (the token cache is keyed by it)
    cache: Path
    scratch: Path
    device: str = "cuda"
    shape: Shape = GPT2_SMALL
    steps: int = STEPS
    warmup: int = WARMUP
    nanogpt: Path | None = None

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.device.startswith("cuda") else "float32"


def command(plan: Plan, s: Setup, run_dir: Path, timeout: float) -> tuple[list[str], Path]:
    """(argv, working directory) of a run."""
    sh = s.shape
    if plan.impl == "llmkit":
        spec = s.scratch / "spec.toml"
        if not spec.exists():
            spec.write_text(llmkit_spec(s.corpus, sh, s.device, s.steps, BATCHES[0]))
        cmd = [s.python, "-m", "llmkit.cli", "train", str(spec), "--out", str(run_dir),
               "--set", f"model.attention.name={plan.attention}",
               "--set", f"train.compile={'true' if plan.compiled else 'false'}",
               "--set", f"train.batch_size={plan.batch}",
               "--no-sample", "--no-progress"]  # fmt: skip
        if timeout > 40:  # stop training (keeping its records) before the kill
            cmd += ["--max-time", str(int(timeout - 20))]
        return cmd, ROOT
    if plan.impl == "reference":
        cmd = [s.python, "-m", "benchmarks.reference_gpt", "--data", s.corpus,
               "--device", s.device, "--dtype", s.dtype, "--n-layer", str(sh.n_layer),
               "--n-head", str(sh.n_head), "--n-embd", str(sh.n_embd),
               "--block-size", str(sh.block_size), "--batch-size", str(plan.batch),
               "--max-iters", str(s.steps), "--eval-interval", "1000000", "--eval-iters", "1",
               "--no-full-split", "--log-interval", "1"]  # fmt: skip
        return cmd + (["--compile"] if plan.compiled else []), ROOT
    assert s.nanogpt is not None
    cmd = [s.python, "train.py", "config/train_shakespeare_char.py", f"--device={s.device}",
           f"--dtype={s.dtype}", f"--n_layer={sh.n_layer}", f"--n_head={sh.n_head}",
           f"--n_embd={sh.n_embd}", f"--block_size={sh.block_size}",
           f"--batch_size={plan.batch}", "--dropout=0.0", "--bias=False",
           f"--compile={plan.compiled}", f"--max_iters={s.steps - 1}",
           f"--lr_decay_iters={s.steps}", "--eval_interval=1000000", "--eval_iters=1",
           "--log_interval=1", f"--out_dir={run_dir}"]  # fmt: skip
    return cmd, s.nanogpt


# -- processes --------------------------------------------------------------------------------

_LIVE: set[subprocess.Popen] = set()


def kill_children() -> None:
    """End the process groups of the runs still going (started here, each its own group)."""
    for proc in list(_LIVE):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _LIVE.discard(proc)


def run_process(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout: float, log: Path, title: str
) -> tuple[int | None, bool, float, str]:
    """Run ``cmd`` in its own process group with its output appended to ``log`` under a
    header; (exit status or None, timed out, seconds, its output). At ``timeout`` the group
    gets SIGTERM, then SIGKILL 5 s later."""
    with log.open("a", encoding="utf-8") as fh:
        fh.write(f"\n===== {title}\n$ (cd {cwd} && {' '.join(cmd)})\n")
        fh.flush()
        start = fh.tell()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        _LIVE.add(proc)
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        except BaseException:  # a signal to us, Ctrl-C: the run goes too
            kill_children()
            raise
        finally:
            _LIVE.discard(proc)
        wall = time.monotonic() - t0
    with log.open("r", encoding="utf-8", errors="replace") as fh:
        fh.seek(start)
        output = fh.read()
    with log.open("a", encoding="utf-8") as fh:
        what = "TIMED OUT" if timed_out else f"exit {proc.returncode}"
        fh.write(f"----- {title}: {what} after {wall:.1f} s\n")
    return (None if timed_out else proc.returncode), timed_out, wall, output


Runner = Callable[[list[str], Path, dict[str, str], float, Path, str],
                  tuple[int | None, bool, float, str]]  # fmt: skip


def _tail(text: str, n: int = 2) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-300:]


def blockers(plan: Plan, s: Setup) -> str | None:
    """Why ``plan`` cannot run here (None when it can)."""
    if plan.impl in ("llmkit", "reference") and not (ROOT / s.corpus).is_file():
        return f"no corpus at {s.corpus} (gpu_check.sh --prepare copies it in)"
    if plan.impl == "llmkit":
        import importlib.util

        tokens = list((s.cache / "tokens").glob("train-*.bin"))
        if importlib.util.find_spec("datasets") is None and not tokens:
            return (f"no `datasets` and no token cache in {s.cache}: run gpu_check.sh "
                    f"--prepare where datasets works and carry {CARRY}")  # fmt: skip
    if plan.impl == "nanogpt":
        if s.nanogpt is None or not (s.nanogpt / "train.py").is_file():
            return f"no nanoGPT train.py in {s.nanogpt}"
        data = s.nanogpt / "data" / "shakespeare_char"
        if not (data / "train.bin").is_file() or not (data / "meta.pkl").is_file():
            return f"no {data}/train.bin, meta.pkl (benchmarks/scripts/nanogpt_data.py)"
    return None


def run_all(
    s: Setup,
    todo: list[Plan],
    deadline: float,
    log: Path,
    on_result: Callable[[list[Result]], None] | None = None,
    runner: Runner = run_process,
    say: Callable[[str], None] = print,
) -> list[Result]:
    """Run ``todo`` in order while time lasts (``deadline``: ``time.monotonic()``); each
    result is passed to ``on_result`` (with all so far) as it lands."""
    results = [Result(p.key, p.impl, p.label, p.mode, p.batch) for p in todo]
    seen: dict[tuple[str, bool], float] = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLMKIT_CACHE_DIR": str(s.cache)}
    env.pop("TRITON_INTERPRET", None)
    if s.device == "cpu":  # a dry run: two threads on a shared CPU can be 50× slower than one
        env["OMP_NUM_THREADS"] = "1"
    fpt = s.shape.flops_per_token()
    for plan, res in zip(todo, results):
        left = deadline - time.monotonic()
        same = [v for (impl, comp), v in seen.items() if comp == plan.compiled]
        expect = seen.get((plan.impl, plan.compiled)) or max(same, default=0.0)
        expect = expect or EXPECTED_S[plan.compiled]
        why = blockers(plan, s)
        if why is None and expect > left:
            why = f"not started: ~{expect:.0f} s expected, {max(left, 0):.0f} s left"
        if why is not None:
            res.status, res.reason = "skipped", why
            say(f"  e2e {plan.key}: skipped ({why})")
            if on_result:
                on_result(results)
            continue
        run_dir = s.scratch / plan.key.replace(":", "-")
        timeout = min(left, MAX_RUN_S)
        cmd, cwd = command(plan, s, run_dir, timeout)
        res.command = " ".join(cmd)
        rc, timed_out, wall, output = runner(cmd, cwd, env, timeout, log, plan.key)
        res.rc, res.wall_s = rc, round(wall, 1)
        tokens = plan.batch * s.shape.block_size
        if plan.impl == "llmkit":
            samples = parse_metrics(run_dir / "metrics.jsonl", tokens)
            measure(res, samples, tokens, fpt, s.warmup)
        else:  # nanoGPT logs a percentage of an A100's peak
            scale = NANOGPT_PEAK / PEAK_FLOPS / 100
            measure(res, parse_iter_lines(output), tokens, fpt, s.warmup, scale)
        seen[(plan.impl, plan.compiled)] = max(seen.get((plan.impl, plan.compiled), 0.0), wall)
        done = res.ms_per_iter is not None
        if timed_out:
            res.status = "partial" if done else "timeout"
            res.reason = f"cut at {timeout:.0f} s after {res.iters} iterations"
        elif rc != 0:
            res.status = "partial" if done else "error"
            res.reason = f"exit {rc}: {_tail(output)}"
        elif not done:
            res.status, res.reason = "error", f"{res.iters} iterations logged: {_tail(output)}"
        else:
            res.status = "ok"
        shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints: ~1 GB a run
        figure = (f"{res.ms_per_iter:.1f} ms/iter, {res.tokens_per_s:,.0f} tok/s, "
                  f"MFU {100 * res.mfu:.1f}%" if done else "no figure")  # fmt: skip
        say(f"  e2e {plan.key}: {res.status}, {figure} ({wall:.0f} s)")
        if on_result:
            on_result(results)
    return results


# -- report -----------------------------------------------------------------------------------


def markdown(
    results: list[Result], shape: Shape = GPT2_SMALL, device: str = "cuda", warmup: int = WARMUP
) -> str:
    """The side-by-side table, ratios of tokens/s to nanoGPT's and reference_gpt's in the
    same mode and batch."""
    fpt = shape.flops_per_token()
    by = {(r.impl, r.mode, r.batch): r for r in results if r.tokens_per_s}
    head = ["implementation", "mode", "batch", "tok/s", "ms/iter", "MFU", "vs nanoGPT",
            "vs reference_gpt", "timed iters", "wall s", "status"]  # fmt: skip
    lines = [
        f"Shape: {shape.n_layer} layers, width {shape.n_embd}, {shape.n_head} heads, context "
        f"{shape.block_size}, vocabulary {VOCAB}, {device}. ms/iter: median of each run's own "
        f"per-iteration times after the first {warmup}. MFU: (6·N + 12·L·H·Q·T) = "
        f"{fpt / 1e6:.1f} MFLOP per token (nanoGPT's estimate_mfu) × tok/s ÷ "
        f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s (H100/H200 SXM dense bf16) for every run; nanoGPT's "
        f"own log divides by {NANOGPT_PEAK / 1e12:.0f} (an A100).\n",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]

    def ratio(r: Result, impl: str) -> str:
        other = by.get((impl, r.mode, r.batch))
        if r.tokens_per_s is None or other is None or other is r:
            return "-"
        return f"{r.tokens_per_s / other.tokens_per_s:.2f}×"

    for r in results:
        if r.status == "skipped":
            continue
        fig = r.tokens_per_s is not None
        row = [r.label, r.mode, str(r.batch),
               f"{r.tokens_per_s:,.0f}" if fig else "-",
               f"{r.ms_per_iter:.1f}" if fig else "-",
               f"{100 * r.mfu:.1f}%" if fig and r.mfu is not None else "-",
               ratio(r, "nanogpt"), ratio(r, "reference"), str(r.timed),
               f"{r.wall_s:.0f}" if r.wall_s is not None else "-",
               r.status + (f" ({r.reason})" if r.reason and r.status != "ok" else "")]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    skipped = [r for r in results if r.status == "skipped"]
    if skipped:
        lines.append("")
        lines += [f"- not run: {r.key}: {r.reason}" for r in skipped]
    return "\n".join(lines) + "\n"


# -- preparing the carried data ---------------------------------------------------------------


def find_corpus() -> Path | None:
    for rel in (DEFAULT_CORPUS, *SOURCES):
        p = (ROOT / rel).resolve()
        if p.is_file():
            return p
    return None


@contextlib.contextmanager
def _cache_env(cache: Path) -> Iterator[None]:
    old = os.environ.get("LLMKIT_CACHE_DIR")
    os.environ["LLMKIT_CACHE_DIR"] = str(cache)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LLMKIT_CACHE_DIR", None)
        else:
            os.environ["LLMKIT_CACHE_DIR"] = old


def prepare_cache(corpus: str, cache: Path, scratch: Path) -> list[str]:
    """Tokenize ``corpus`` (relative to ROOT) for the e2e spec into the shared data cache
    ``cache``; the log lines of :func:`llmkit.data.prepare_data`."""
    from llmkit.data import prepare_data
    from llmkit.spec import load_spec

    spec = scratch / "spec.toml"
    spec.write_text(llmkit_spec(corpus, GPT2_SMALL, "cpu", STEPS, BATCHES[0]))
    lines: list[str] = []
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with _cache_env(cache):
            rs = load_spec(spec)
            prepare_data(rs, scratch / "run", log=lines.append)
    finally:
        os.chdir(cwd)
    return lines


_NO_DATASETS = 'raise ImportError("datasets is absent (as on the GPU machine)")\n'


def check_cache(python: str, corpus: str, cache: Path, scratch: Path) -> tuple[bool, str]:
    """Whether a child that cannot import ``datasets`` takes the tokenizer and both token
    files from ``cache`` (what the GPU run does); its output."""
    block = scratch / "no-datasets"
    block.mkdir(parents=True, exist_ok=True)
    (block / "datasets.py").write_text(_NO_DATASETS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(block), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    code = (
        "import sys; from pathlib import Path; "
        "from benchmarks.scripts.gpu_train_compare import prepare_cache; "
        f"lines = prepare_cache({corpus!r}, Path({str(cache)!r}), "
        f"Path({str(scratch / 'check')!r})); "
        "print('\\n'.join(lines)); "
        "sys.exit(0 if sum('shared cache' in ln for ln in lines) == 2 "
        "and any('earlier run' in ln for ln in lines) else 1)"
    )
    (scratch / "check").mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([python, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def prepare(corpus_src: Path, nanogpt: Path | None, python: str = sys.executable) -> int:
    """``--prepare``: the corpus into ``.gpucheck/data``, its tokens into ``.gpucheck/cache``
    (checked without ``datasets``), nanoGPT's data files; the folders to carry."""
    from benchmarks.scripts import nanogpt_data

    dst = ROOT / DEFAULT_CORPUS
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.is_file() or dst.read_bytes() != corpus_src.read_bytes():
        shutil.copyfile(corpus_src, dst)
    exclude = ROOT / ".git" / "info" / "exclude"
    if exclude.parent.is_dir():
        lines = exclude.read_text().splitlines() if exclude.is_file() else []
        if f"/{CARRY}/" not in lines:
            with exclude.open("a") as fh:
                fh.write(f"/{CARRY}/\n")
    cache = ROOT / CACHE
    with tempfile.TemporaryDirectory(prefix="gpu-e2e-prepare-") as tmp:
        for line in prepare_cache(DEFAULT_CORPUS, cache, Path(tmp)):
            print(f"  {line}")
        ok, out = check_cache(python, DEFAULT_CORPUS, cache, Path(tmp))
    print(f"cache check without datasets: {'ok' if ok else 'FAILED'}")
    if not ok:
        print(out)
        return 1
    carry = [CARRY, ".whl"]
    if nanogpt is not None:
        info = nanogpt_data.prepare(dst, nanogpt)
        print(f"nanoGPT data: {info['dir']} ({', '.join(info['written']) or 'unchanged'})")
        with contextlib.suppress(ValueError):
            carry.append(str(nanogpt.resolve().relative_to(ROOT)))
    sizes = {c: _du(ROOT / c) for c in carry if (ROOT / c).exists()}
    print("carry: " + ", ".join(f"{c} ({n / 2**20:.1f} MiB)" for c, n in sizes.items()))
    return 0


# -- command line -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check", help="directory")
    ap.add_argument("--nanogpt", type=Path, help="nanoGPT's checkout (with its data prepared)")
    ap.add_argument("--corpus", help=f"corpus (default {DEFAULT_CORPUS}; --prepare: found)")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for all runs")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma list")
    ap.add_argument("--steps", type=int, default=STEPS, help="iterations per run")
    ap.add_argument("--eager-only", action="store_true", help="no torch.compile runs")
    ap.add_argument("--prepare", action="store_true", help="make the carried data (here)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, eager, seconds")
    args = ap.parse_args(argv)
    if args.prepare:
        src = Path(args.corpus) if args.corpus else find_corpus()
        if src is None or not src.is_file():
            print(f"error: no corpus found (tried {DEFAULT_CORPUS}, {', '.join(SOURCES)})")
            return 2
        return prepare(src, args.nanogpt)
    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = tuple(int(b) for b in args.batches.split(","))
    dry = args.dry_run
    if not dry:
        import torch

        if not torch.cuda.is_available():
            print("error: the end-to-end comparison needs a CUDA GPU (--dry-run: CPU)")
            return 2
    with tempfile.TemporaryDirectory(prefix="gpu-e2e-") as tmp:
        s = Setup(
            python=sys.executable, corpus=args.corpus or DEFAULT_CORPUS, cache=ROOT / CACHE,
            scratch=Path(tmp), device="cpu" if dry else "cuda",
            shape=DRY_SHAPE if dry else GPT2_SMALL, steps=min(args.steps, 6) if dry else args.steps,
            warmup=1 if dry else WARMUP, nanogpt=args.nanogpt.resolve() if args.nanogpt else None,
        )  # fmt: skip
        todo = plans(batches[:1] if dry else batches, s.nanogpt is not None,
                     compiled=not (dry or args.eager_only))  # fmt: skip

        def save(results: list[Result]) -> None:
            (out / "e2e.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
            (out / "e2e.md").write_text(markdown(results, s.shape, s.device, s.warmup))

        try:
            results = run_all(s, todo, t0 + args.budget, out / "e2e.log", save)
        finally:
            kill_children()
    print(markdown(results, s.shape, s.device, s.warmup))
    return 0 if all(r.status in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
