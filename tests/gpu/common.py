"""What the end-to-end GPU tests share: the device they run on, the corpus, the spec, the
memory logger, and the tolerances (each with the reason for its size).

The device is CUDA when a GPU is visible. ``LLMKIT_GPU_TESTS_DEVICE=cpu`` runs the same
tests on the CPU instead, to check their logic on a machine without a GPU: there the
``flash`` component takes its PyTorch (SDPA) reference path and ``sliding_window`` its C or
block-local path, so the comparisons still run, against other code than on a GPU.
``LLMKIT_GPU_TESTS_DEVICE=cuda`` insists on a GPU (an error, not a skip, without one).
"""

from __future__ import annotations

import json
import os
import random
import resource
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from llmkit import hardware
from llmkit.contracts import LoggerContext, MetricsLogger, NoOptions
from llmkit.hookspecs import hookimpl

DEVICE_ENV = "LLMKIT_GPU_TESTS_DEVICE"
#: Lines the tests add for the end of pytest's report (measured differences, run times), so a
#: passing GPU run shows how far inside its tolerances it is.
REPORT = pytest.StashKey[list[str]]()


def chosen_device() -> tuple[str | None, str]:
    """(the device the tests run on, or None; why not, when None)."""
    want = os.environ.get(DEVICE_ENV, "").strip().lower()
    if want == "cpu":
        return "cpu", ""
    if want not in ("", "cuda"):
        return None, f"{DEVICE_ENV}={want!r} is neither 'cpu' nor 'cuda'"
    if torch.cuda.is_available():
        return "cuda", ""
    return None, (
        "no CUDA GPU: the end-to-end GPU tests need one "
        f"({DEVICE_ENV}=cpu runs their logic on the CPU)"
    )


DEVICE, SKIP_REASON = chosen_device()
CUDA = DEVICE == "cuda"

#: bf16 autocast, as GPU training runs. On a CPU only where bf16 is native (AVX512-BF16,
#: AMX): emulated bf16 is ~100× slower there (docs/training.md), so fp32 elsewhere.
PRECISION = "bf16" if CUDA or hardware.cpu_has_fast_bf16() else "fp32"

# -- the recipe ---------------------------------------------------------------------------------
STEPS = 30  # optimizer steps of every full run
HALF = 15  # where the interrupted run of the resume test stops (an evaluation + checkpoint)
BLOCK = 128  # tokens a row (= model.max_seq_len)
BATCH = 8
BAND = 32  # sliding_window's window where it must differ from full attention
MODEL: dict[str, Any] = {
    "vocab_size": 64,  # replaced by the character tokenizer's size
    "d_model": 128,
    "n_layers": 2,
    "n_heads": 4,  # head dim 32
    "max_seq_len": BLOCK,
    "dropout": 0.0,  # the runs compare step by step: no random masks
    "position": {"name": "rope"},
}

#: variant -> (model.attention, train.compile)
VARIANTS: dict[str, tuple[dict[str, Any], bool]] = {
    "sdpa": ({"name": "sdpa"}, False),
    "flash": ({"name": "flash"}, False),
    # a window as long as the block: the same attention as sdpa's, through the window kernel
    "sliding_window": ({"name": "sliding_window", "window": BLOCK}, False),
    # a window shorter than the block, against the dense reference with the same window
    "sliding_window_band": ({"name": "sliding_window", "window": BAND}, False),
    "dense_band": ({"name": "dense", "window": BAND}, False),
    "sdpa+compile": ({"name": "sdpa"}, True),
    "flash+compile": ({"name": "flash"}, True),
    "sliding_window+compile": ({"name": "sliding_window", "window": BLOCK}, True),
}

# -- tolerances ---------------------------------------------------------------------------------
#: Per-step |Δloss| between a run and the eager ``sdpa`` run of the same seed and data, over
#: all 30 steps. Under bf16 autocast, q/k/v and the attention output are bf16 (8 significant
#: bits, a rounding of up to 2⁻⁹ ≈ 0.2 %); two correct kernels accumulate in fp32 in a
#: different order and so round a small share of outputs one bf16 step apart. The loss, a
#: mean over 1,024 targets, moves by ~1e-5 at step 1 from that; Adam then amplifies the
#: difference step by step (its update is close to ±lr per weight whatever the gradient's
#: size). Measured on a CPU in bf16 (sdpa there computes in fp32, flash's reference path in
#: bf16, so they differ more than two GPU kernels should): every correct pair, compiled or
#: not, stayed within 1.9e-3–3.4e-3 over the 30 steps (the worst at step 6, while the loss
#: falls fastest), 6–10× inside this. A 32-key window instead of full attention (a masking
#: error) is 0.14 apart at worst, 7× outside it (``test_the_comparison_tells_...``).
LOSS_ATOL = 2e-2
#: The last step's loss, relative (a 1 % band at the final loss of ~1.6 is 0.016 nats). On the
#: CPU correct pairs ended ≤ 6e-4 apart, the 32-key window 9 % apart.
FINAL_RTOL = 1e-2
#: Step 1 sees the same weights and batch in every run: only the forward differs, by
#: rounding (above), so its loss must agree far more tightly than the trajectory (CPU: ≤ 3.5e-5
#: for correct pairs; 2.3e-3 for the 32-key window, which the trajectory catches anyway).
FIRST_ATOL = 2e-3
#: Step 1's gradient norm, relative: the same weights and batch, so this compares the
#: backward passes (fp32 gradients of bf16 products; rounding moved it ≤ 1.5e-4 on the CPU; a
#: wrong or missing dQ/dK/dV term changes it by far more than 2 %).
FIRST_GRAD_RTOL = 2e-2
#: The runs must learn: the mean of the last 5 losses at least this far below step 1's.
MIN_LEARNED = 0.5

#: Memory after a step must not grow from step 10 to step 30 (steady state: the same
#: shapes every step, the optimizer's state made at step 1). On CUDA the caching allocator's
#: ``memory_allocated`` counts every live tensor exactly, so it should not move at all; the
#: slack of 4 KiB is less than one leaked 0-dim CUDA tensor (a 512-byte block) per step over
#: 20 steps (10 KiB), the smallest leak worth catching (a loss kept on the device per step).
#: The per-step peak (``max_memory_allocated``, reset after each step) may vary by a block or
#: two of the allocator's rounding: 1 MiB. On a CPU these are the process's resident and peak
#: resident sizes, which malloc's arenas and Python move by megabytes: 16 MiB.
MEMORY_SLACK = 4 * 1024 if CUDA else 16 * 2**20
PEAK_SLACK = 2**20 if CUDA else 16 * 2**20
MEMORY_FROM = 10  # warm-up: the steps before are not compared

# -- the corpus ---------------------------------------------------------------------------------
_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the king", "a bird", "the cook"]
_VERBS = ["sees", "likes", "follows", "finds", "paints", "hears", "feeds", "calls"]
_OBJECTS = ["the moon", "a red ball", "the river", "her friend", "the garden", "a small boat"]
_ENDS = [".", ".", ".", "!", "?"]


def corpus(sentences: int = 6000, seed: int = 0) -> str:
    """A deterministic character corpus (≈ 160 KB, 29 characters) with structure a small
    model picks up in a few steps: sentences from a tiny grammar, lines of 1–4 sentences."""
    rng = random.Random(seed)
    lines, line = [], []
    for _ in range(sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        line.append(s + rng.choice(_ENDS))
        if len(line) >= rng.randint(1, 4):
            lines.append(" ".join(line).capitalize())
            line = []
    return "\n".join(lines) + "\n"


def write_spec(
    where: Path,
    attention: dict[str, Any],
    *,
    compile: bool = False,
    model: dict[str, Any] | None = None,
    schedule: dict[str, Any] | None = None,
    **train: Any,
) -> Path:
    """A spec file in ``where`` (with its corpus) training the small model with ``attention``
    on :data:`DEVICE` in :data:`PRECISION` for :data:`STEPS` steps, evaluating and saving
    at :data:`HALF` and at the end, every step logged (and to the memory logger); ``model``,
    ``schedule`` and ``train`` keywords override the spec's."""
    where.mkdir(parents=True, exist_ok=True)
    text = where / "corpus.txt"
    text.write_text(corpus())
    spec = {
        "name": "gpu-e2e",
        "model": {**MODEL, "attention": attention, **(model or {})},
        "tokenizer": {"kind": "char"},
        "data": {"source": {"name": "text", "paths": [str(text)], "val_fraction": 0.05}},
        "optimizer": {"name": "adamw", "lr": 3e-3},
        "schedule": schedule or {"name": "cosine", "warmup_steps": 3},
        "train": {
            "batch_size": BATCH,
            "max_steps": STEPS,
            "eval_interval": HALF,
            "eval_batches": 2,
            "log_interval": 1,
            "precision": PRECISION,
            "device": DEVICE or "cpu",
            "compile": compile,
            "plot": False,
            "sample_tokens": 0,
            "seed": 1337,
            "loggers": [{"name": MEMORY_LOGGER}],
            **train,
        },
    }
    path = where / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def quiet(**kw: Any) -> dict[str, Any]:
    """``train()`` keyword arguments for a silent run."""
    return {"log": lambda _m: None, "progress": False, **kw}


def read_metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def step_lines(run: Path) -> list[dict[str, Any]]:
    """The run's training lines of ``metrics.jsonl``, in step order."""
    return [m for m in read_metrics(run) if "loss" in m]


# -- memory -------------------------------------------------------------------------------------
MEMORY_LOGGER = "gpu_test_memory"
MEMORY_FILE = "memory.jsonl"


def memory_now() -> dict[str, int]:
    """Bytes in use now and at most since the last call (CUDA: the caching allocator's counts,
    the peak then reset; CPU: resident set size and the process's peak resident size)."""
    if CUDA:
        now = torch.cuda.memory_allocated()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return {"allocated": now, "peak": peak}
    with open("/proc/self/statm") as fh:
        rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"allocated": rss, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class MemoryLogger(MetricsLogger):
    """A ``logger`` component (``train.loggers``): after every logged training step it appends
    the memory in use and the step's peak to ``<run>/memory.jsonl``. Loggers receive each
    step's record right after the step, so this measures what ``llmkit train`` holds between
    steps without reaching into the trainer."""

    Options = NoOptions

    def __init__(self, options: NoOptions, ctx: LoggerContext) -> None:
        self.path = ctx.run_dir / MEMORY_FILE
        if CUDA:
            torch.cuda.reset_peak_memory_stats()

    def log(self, record: dict[str, Any]) -> None:
        if "loss" not in record:  # evaluation lines
            return
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": record["step"], **memory_now()}) + "\n")


class MemoryPlugin:
    """The plugin that registers :class:`MemoryLogger` (added to the process registry by
    tests/gpu/conftest.py for each test module)."""

    @hookimpl
    def register_components(self, register: Any) -> None:
        register("logger", MEMORY_LOGGER, MemoryLogger, summary="memory after each step (tests)")


def memory_lines(run: Path) -> list[dict[str, int]]:
    return [json.loads(line) for line in (run / MEMORY_FILE).read_text().splitlines()]
