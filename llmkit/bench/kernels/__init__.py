"""Timing kernels across every registered component of a kind (``llmkit bench kernels``,
``benchmarks/kernels/test_kernels.py``, ``benchmarks/scripts/gpu_check.py``).

A kind is benchmarkable when its registry record names a bench adapter (``bench =
"module:attr"``, a :class:`KernelBench`): attention, ffn and norm do, and so does any plugin
kind that declares one. The adapter says what a case is, how inputs are made, how the work is
counted and which columns the tables show (:mod:`llmkit.bench.kernels.adapters`).

Every component of a kind is built from the registry with its default options (or options
given per component), so a plugin's kernel joins without edits. A component that cannot run a
case is skipped with a reason, never special-cased by name: its capabilities say so
(``requires = ["cuda"]`` off a GPU, ``causal_only`` for a non-causal case), its options do
not validate, or it raises ``NotImplementedError``, ``ValueError`` or out-of-memory on a
trial call.

What each record holds (:func:`bench_kernels` returns a list of dicts):

- ``median_s`` / ``min_s`` / ``max_s``: median, fastest and slowest per-call time over
  ``repeats`` repeats (``times_s``: each repeat's), each of ``number`` back-to-back calls
  (``number`` calibrated so one repeat lasts ≳ 5 ms), after ``warmup`` calls (the first call
  compiles Triton kernels). On CUDA the calls are timed with CUDA events; on a CPU with
  ``time.perf_counter``. ``spread`` = (max − min) / median, None with one repeat.
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
  ``within_noise``: the two medians differ by no more than the two ranges of the repeats
  (max − min) together, so the speed-up may be noise (tables mark it ``(noise)``); None for
  the baseline itself or with a single repeat.

Modules: :mod:`~llmkit.bench.kernels.timing` (time, peak memory, devices and dtypes),
:mod:`~llmkit.bench.kernels.flops` (work formulas), :mod:`~llmkit.bench.kernels.entries` (what
is benchmarked), :mod:`~llmkit.bench.kernels.adapters` (per kind),
:mod:`~llmkit.bench.kernels.runner` (the sweep, ratios) and
:mod:`~llmkit.bench.kernels.report` (JSON, plots, tables). The command that reads flags and
prints is ``llmkit bench kernels`` (:mod:`llmkit.cli.bench_kernels`).
"""

from llmkit.bench.kernels.adapters import (
    ATTENTION_ADAPTER,
    D_MODEL,
    FFN_ADAPTER,
    HEAD_DIMS,
    NORM_ADAPTER,
    QUICK,
    SEQ_LENS,
    TOKENS,
    AttentionBench,
    Case,
    Column,
    KernelBench,
    NotBenchmarkable,
    TokenBench,
    adapter_for,
    benchmarkable_kinds,
    default_attention_shape,
    prepare_attention,
    prepare_tokens,
)
from llmkit.bench.kernels.entries import Entry, Prepared, Unsupported, build, entries
from llmkit.bench.kernels.flops import (
    ATTENTION_FLOPS,
    FFN_FLOPS,
    MODES,
    NORM_BYTES,
    attention_flops,
    attention_pairs,
    ffn_flops,
    norm_bytes,
)
from llmkit.bench.kernels.report import (
    NOISE_NOTE,
    markdown_table,
    meta,
    pivot_markdown,
    plot,
    rich_table,
    table_rows,
    write_json,
)
from llmkit.bench.kernels.runner import add_ratios, bench_kernels
from llmkit.bench.kernels.timing import (
    CPU_MEMORY,
    CUDA_MEMORY,
    DTYPES,
    cpu_peak_allocated,
    default_dtype,
    device_name,
    dtype_name,
    parse_dtype,
    peak_memory,
    summarize,
    time_step,
    within_noise,
)

__all__ = [
    "ATTENTION_ADAPTER",
    "ATTENTION_FLOPS",
    "CPU_MEMORY",
    "CUDA_MEMORY",
    "DTYPES",
    "D_MODEL",
    "FFN_ADAPTER",
    "FFN_FLOPS",
    "HEAD_DIMS",
    "MODES",
    "NOISE_NOTE",
    "NORM_ADAPTER",
    "NORM_BYTES",
    "QUICK",
    "SEQ_LENS",
    "TOKENS",
    "AttentionBench",
    "Case",
    "Column",
    "Entry",
    "KernelBench",
    "NotBenchmarkable",
    "Prepared",
    "TokenBench",
    "Unsupported",
    "adapter_for",
    "add_ratios",
    "attention_flops",
    "attention_pairs",
    "bench_kernels",
    "benchmarkable_kinds",
    "build",
    "cpu_peak_allocated",
    "default_attention_shape",
    "default_dtype",
    "device_name",
    "dtype_name",
    "entries",
    "ffn_flops",
    "markdown_table",
    "meta",
    "norm_bytes",
    "parse_dtype",
    "peak_memory",
    "pivot_markdown",
    "plot",
    "prepare_attention",
    "prepare_tokens",
    "rich_table",
    "summarize",
    "table_rows",
    "time_step",
    "within_noise",
    "write_json",
]
