"""Measuring generation: prompt processing and decoding throughput, time to first token,
and peak memory, for several batch sizes (``llmkit bench generate``).

Every figure is the median of ``repeats`` runs after one warm-up run, on random prompts of
``prompt_len`` tokens, greedy decoding of exactly ``new_tokens`` tokens (EOS ignored):

- ``prefill_tokens_per_s``: batch · prompt_len / the time of the prompt's forward pass into
  an empty KV cache;
- ``ttft_s``: time to first token, from the call to the first token chosen (prefill plus
  one sampling step), as a user would see it;
- ``decode_tokens_per_s``: batch · (new_tokens − 1) / the time from the first token to
  the last;
- ``peak_memory_bytes``: the high-water mark during the timed runs, weights included: on
  CUDA ``torch.cuda.max_memory_allocated``; on CPU the process's resident memory, sampled
  every millisecond from /proc (``ru_maxrss``, the lifetime peak, elsewhere) — so it also
  counts the Python interpreter and the torch runtime (a few hundred MB);
- ``kv_cache_bytes``: the KV cache's allocated buffers at the end of the run;
- ``read_bytes_per_step``: the weight bytes one decoding step reads
  (:func:`~llmkit.inference.quantize.decode_read_bytes`: every weight but the looked-up
  embedding tables; an int8 head counts its int8 bytes);
- ``read_bandwidth``: the memory read bandwidth measured here
  (:func:`llmkit.hardware.measure_read_bandwidth`, bytes/s);
- ``limit_tokens_per_s``: the memory-bandwidth bound per sequence, ``read_bandwidth /
  read_bytes_per_step``: each step streams every weight once and gives each row one token,
  so no decoder reads its weights faster (the KV cache, read too, is left out, so the
  bound is optimistic); ``fraction_of_limit``: decode tokens/s per sequence ÷ that bound.
"""

from __future__ import annotations

import resource
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from llmkit.hardware import measure_read_bandwidth
from llmkit.inference.decode import DecodeContext, Row, model_device, sample_steps
from llmkit.inference.layout import fit_layout
from llmkit.inference.quantize import decode_read_bytes, weight_bytes
from llmkit.inference.sampling import Sampling
from llmkit.model import Transformer


@dataclass
class GenerateTiming:
    batch_size: int
    prompt_len: int
    new_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    ttft_s: float
    decode_s: float
    peak_memory_bytes: int
    weight_bytes: int
    kv_cache_bytes: int
    kv_cache: bool  # decoding through a KV cache (else full forwards)
    read_bytes_per_step: int = 0
    read_bandwidth: float = 0.0  # bytes/s
    limit_tokens_per_s: float = 0.0  # per sequence
    fraction_of_limit: float = 0.0

    def as_dict(self) -> dict[str, float | int | bool]:
        return asdict(self)


class PeakMemory:
    """The high-water mark of memory in use during a ``with`` block (see the module
    docstring): CUDA allocations on a GPU, resident memory of the process on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = Path("/proc/self/statm")

    def _rss(self) -> int:
        if self._proc.exists():
            pages = int(self._proc.read_text().split()[1])
            return pages * resource.getpagesize()
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def _poll(self) -> None:
        high = self._rss()
        while not self._stop.wait(0.001):
            high = max(high, self._rss())
        self.peak = max(high, self._rss())

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_run(
    model: Transformer, prompts: list[list[int]], new_tokens: int
) -> tuple[float, float, float, int]:
    """(prefill seconds, time to first token, decode seconds, kv bytes) of one generation."""
    device = model_device(model)
    with torch.inference_mode():
        ctx = DecodeContext(model, prompts, 0, new_tokens)
        _sync(device)
        t0 = time.perf_counter()
        ctx.prefill()
        _sync(device)
        prefill = time.perf_counter() - t0
    del ctx
    rows = [Row(p) for p in prompts]
    cfg = Sampling(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    with torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        ctx = DecodeContext(model, prompts, 0, new_tokens)
        steps = sample_steps(model, rows, cfg, 0, ctx)
        next(steps)  # the first token is chosen (and fed) when the first step yields
        first = time.perf_counter() - t0
        for _ in steps:
            pass
        _sync(device)
        total = time.perf_counter() - t0
    kv = ctx.cache.nbytes() if ctx.cache is not None else 0
    return prefill, first, total - first, kv


def bandwidth_limit(read_bytes_per_step: int, bandwidth: float) -> float:
    """Decode tokens/s per sequence that ``bandwidth`` (bytes/s) allows when every step
    reads ``read_bytes_per_step`` bytes of weights (the memory-bandwidth bound)."""
    if read_bytes_per_step <= 0 or bandwidth <= 0:
        raise ValueError("the bound needs positive bytes per step and bandwidth")
    return bandwidth / read_bytes_per_step


def bench_generate(
    model: Transformer,
    batch_sizes: tuple[int, ...] = (1, 8),
    prompt_len: int = 128,
    new_tokens: int = 128,
    repeats: int = 3,
    seed: int = 0,
    bandwidth: float | None = None,
) -> list[GenerateTiming]:
    """Time greedy generation of ``new_tokens`` after random ``prompt_len``-token prompts
    at each batch size (see the module docstring for what each figure means).
    ``bandwidth`` (bytes/s) is measured on the model's device unless given."""
    if new_tokens < 2:
        raise ValueError("new_tokens must be ≥ 2 to time decoding")
    model.eval()
    device = model_device(model)
    read_bytes = decode_read_bytes(model)
    if bandwidth is None:
        bandwidth = measure_read_bandwidth(device)
    limit = bandwidth_limit(read_bytes, bandwidth) if read_bytes else 0.0
    prompt_len = max(1, min(prompt_len, model.config.max_seq_len - 1))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for b in batch_sizes:
        prompts = torch.randint(0, model.config.vocab_size, (b, prompt_len), generator=gen)
        rows = prompts.tolist()
        fit_layout(model, b)  # as a generation of b rows would
        _one_run(model, rows, new_tokens)  # warm-up
        runs = []
        peak = 0
        for _ in range(repeats):
            with PeakMemory(device) as mem:
                runs.append(_one_run(model, rows, new_tokens))
            peak = max(peak, mem.peak)
        prefill = statistics.median(r[0] for r in runs)
        first = statistics.median(r[1] for r in runs)
        decode = statistics.median(r[2] for r in runs)
        per_seq = (new_tokens - 1) / decode
        out.append(
            GenerateTiming(
                batch_size=b,
                prompt_len=prompt_len,
                new_tokens=new_tokens,
                prefill_tokens_per_s=b * prompt_len / prefill,
                decode_tokens_per_s=b * per_seq,
                ttft_s=first,
                decode_s=decode,
                peak_memory_bytes=peak,
                weight_bytes=weight_bytes(model),
                kv_cache_bytes=runs[-1][3],
                kv_cache=model.supports_kv_cache,
                read_bytes_per_step=read_bytes,
                read_bandwidth=bandwidth,
                limit_tokens_per_s=limit,
                fraction_of_limit=per_seq / limit if limit else 0.0,
            )
        )
    return out


@dataclass
class GenerateBench:
    """``bench_generate`` over a run's model (or a spec's random one), with what it ran on."""

    name: str
    device: str
    threads: int
    params: int
    quantize: str | None  # the method that ran (``auto`` resolved)
    quantize_backend: str | None
    supports_kv_cache: bool
    rows: list[GenerateTiming]

    def meta(self) -> dict[str, object]:
        return {
            "model": self.name,
            "device": self.device,
            "threads": self.threads,
            "quantize": self.quantize,
            "quantize_backend": self.quantize_backend,
            "params": self.params,
        }


def bench_generate_source(
    source: str | Path,
    *,
    overrides: list[str] | None = None,
    weights: str = "final",
    device: torch.device,
    quantize: str | None = None,
    batch_sizes: tuple[int, ...] = (1, 8),
    prompt_len: int = 128,
    new_tokens: int = 128,
    repeats: int = 3,
) -> GenerateBench:
    """Time generation of a run's (or checkpoint's) ``weights``, or of a spec file's shape
    with random weights (``overrides`` apply to a spec file only), optionally quantized."""
    from llmkit.errors import LlmkitError
    from llmkit.inference import prepare_for_decoding

    path = Path(source)
    if path.is_file():  # a spec file: random weights of that shape
        from llmkit.model import build_model
        from llmkit.spec import load_spec

        rs = load_spec(path, overrides or [])
        torch.manual_seed(0)
        model, name = build_model(rs).to(device).eval(), rs.spec.name or path.stem
    else:
        from llmkit.runs import load_run

        if overrides:
            raise LlmkitError("--set applies to a spec file, not a run directory")
        model, name = load_run(path, which=weights, device=str(device)).model, str(path)
    params = model.num_params()
    if quantize:
        from llmkit.inference.quantize import quantize_model

        try:
            model = quantize_model(model, quantize)
        except ValueError as exc:
            raise LlmkitError(str(exc)) from exc
    prepare_for_decoding(model)
    rows = bench_generate(
        model,
        batch_sizes=batch_sizes,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        repeats=repeats,
    )
    info = getattr(model, "quantization", None)
    return GenerateBench(
        name=name,
        device=str(device),
        threads=torch.get_num_threads(),
        params=params,
        quantize=info.method if info is not None else None,
        quantize_backend=info.backend if info is not None else None,
        supports_kv_cache=model.supports_kv_cache,
        rows=rows,
    )
