"""Greedy decoding speed against what users would otherwise use: Hugging Face transformers'
``GPT2LMHeadModel.generate()`` on the very same weights (CPU, fp32, KV cache on both sides).

Our GPT-2-style spec (learned positions, LayerNorm, GELU-tanh MLP, biases, tied embeddings)
is copied into a locally built ``GPT2LMHeadModel`` (no download): our fused qkv ``Linear``
weight is (3·d, d) in q, k, v order, HF's ``Conv1D`` stores (d, 3·d), so weights are
transposed. The suite first checks both give the same logits and the same greedy tokens,
then times the same decode: 32-token prompts (1 and 8 of them) and 64 new tokens, for
llmkit fp32, llmkit int8 (``quantize_model(model, "int8")``: on CPU fbgemm's w8a8-dynamic
linear, the tied head included), llmkit bf16 (``quantize_model(model, "bf16")``: bf16
weights, ATen's product for one row and oneDNN's packed copy for several; timed only where
the CPU has AVX512-BF16 or AMX), llmkit int8
weight-only (fbgemm's int8 product with two-digit activations; where fbgemm is missing, bf16
products where the CPU has them, else not timed) and transformers fp32.

Quick mode: a tiny model (per-token overhead dominates). ``LLMKIT_BENCH=full``: GPT-2 small
(124M parameters). Each batch size is one pytest-benchmark group, so the comparison table
shows the ratios; ``test_llmkit_decodes_faster`` (fp32, batch 1) and
``test_low_precision_decodes_twice_as_fast`` (int8 and int8 weight-only everywhere, bf16 where
the CPU has fast bf16; batch 1 and 8; ≥ 2× at GPT-2 small for each) also check them on
the best of interleaved runs.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

from benchmarks.conftest import FULL
from llmkit.hardware import cpu_has_fast_bf16
from llmkit.inference import Sampling, generate_batch, prepare_for_decoding
from llmkit.inference.quantize import digits_available, quantize_model
from llmkit.model import Transformer, build_model
from llmkit.spec import load_spec_dict
from tests.hf_gpt2 import gpt2_spec, to_hf_gpt2

transformers = pytest.importorskip("transformers")

PROMPT, NEW = 32, 64
BATCHES = (1, 8)
#: d_model, n_layers, n_heads, vocab, max_seq_len
SHAPE = (768, 12, 12, 50257, 1024) if FULL else (64, 2, 4, 512, 128)
THREADS = int(os.environ.get("LLMKIT_BENCH_THREADS", "0")) or (
    torch.get_num_threads() if FULL else 1
)
#: Interleaved rounds of the ratio tests (``LLMKIT_BENCH_ROUNDS``).
ROUNDS = int(os.environ.get("LLMKIT_BENCH_ROUNDS", "0")) or (2 if FULL else 5)
#: Decode ÷ transformers fp32 that test_low_precision_decodes_twice_as_fast requires: the
#: issue's 2× at GPT-2 small for int8 (what ``quantize = "auto"`` picks on a CPU), for int8
#: weight-only on fbgemm (measured on an AVX512-BF16 EPYC: 2.83–2.96× at batch 1) and for
#: bf16 weights where the CPU has fast bf16 (there 2.20–2.41× at batch 1, best of 2, with
#: ATen's one-row product; 2.49–2.98× at batch 8; docs/benchmarks.md); at the quick size
#: (overhead-bound) all only faster.
FAST_BF16 = cpu_has_fast_bf16()
DIGITS = digits_available()
LOW_PRECISION_SPEEDUP = {
    "llmkit-int8": 2.0 if FULL else 1.0,
    "llmkit-bf16": 2.0 if FULL else 1.0,
    "llmkit-int8-weight-only": 2.0 if FULL and DIGITS else 1.0,
}
#: bf16 weights are timed only where the CPU multiplies bf16 natively (elsewhere emulated);
#: int8 weight-only where fbgemm's product or native bf16 runs it (else fp32 products on
#: dequantized weights). In quick mode the layers are under DIGITS_MIN_WEIGHTS: there
#: weight-only is Int8Linear (bf16 products where the CPU has them).
LOW_PRECISION = (
    ["llmkit-int8"]
    + (["llmkit-bf16"] if FAST_BF16 else [])
    + (["llmkit-int8-weight-only"] if DIGITS or FAST_BF16 else [])
)
#: What each low-precision impl is: ``quantize_model`` arguments.
CONVERSIONS = {
    "llmkit-int8": {"method": "int8"},
    "llmkit-bf16": {"method": "bf16"},
    "llmkit-int8-weight-only": {"method": "int8", "backend": "weight_only"},
}


@pytest.fixture(scope="module")
def models():
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    ours = build_model(load_spec_dict(gpt2_spec(*SHAPE))).eval()
    hf = to_hf_gpt2(ours)
    # What `llmkit generate --quantize int8 | bf16 | int8-weight-only` decodes.
    low = {impl: quantize_model(ours, **kw) for impl, kw in CONVERSIONS.items()}
    for model in (ours, *low.values()):
        prepare_for_decoding(model)  # what `llmkit generate` does to the models it loads
    yield {"llmkit": ours, **low, "transformers": hf}
    torch.set_num_threads(threads)


def prompts(batch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, SHAPE[3], (batch, PROMPT), generator=gen)


def run_llmkit(ours: Transformer, prompt: torch.Tensor) -> list[list[int]]:
    cfg = Sampling(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    return [r.ids for r in generate_batch(ours, prompt.tolist(), cfg)]


def run_hf(hf, prompt: torch.Tensor) -> list[list[int]]:
    with torch.inference_mode():
        out = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW,
            do_sample=False,
            use_cache=True,
        )
    return out[:, prompt.shape[1] :].tolist()


def run(models, impl: str, prompt: torch.Tensor) -> list[list[int]]:
    fn = run_hf if impl == "transformers" else run_llmkit
    return fn(models[impl], prompt)


def test_same_logits_and_greedy_tokens(models):
    ours, hf, prompt = models["llmkit"], models["transformers"], prompts(1)
    with torch.no_grad():
        a, b = ours(prompt).logits, hf(prompt).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert run_llmkit(ours, prompt) == run_hf(hf, prompt)


@pytest.mark.parametrize("impl", list(CONVERSIONS))
def test_low_precision_logits_are_close(models, impl):
    """Random weights are the hard case (no margin between logits): measured at GPT-2
    small, the w8a8 error's standard deviation is 6 % of the logits' (cosine 0.998)."""
    prompt = prompts(2)
    with torch.no_grad():
        a, b = models["llmkit"](prompt).logits, models[impl](prompt).logits
    assert float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0)) > 0.99


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("impl", ["llmkit", *LOW_PRECISION, "transformers"])
def test_greedy_decode(benchmark, models, impl, batch):
    benchmark.group = f"greedy-decode-{batch}x{PROMPT}+{NEW}"
    prompt = prompts(batch)
    ids = benchmark.pedantic(
        lambda: run(models, impl, prompt), rounds=3 if FULL else 10, warmup_rounds=1
    )
    assert [len(r) for r in ids] == [NEW] * batch
    benchmark.extra_info["threads"] = THREADS
    if benchmark.stats:
        median = benchmark.stats.stats.median
        benchmark.extra_info["tokens_per_s"] = batch * (PROMPT + NEW) / median
        benchmark.extra_info["ms_per_new_token"] = 1000 * median / NEW


def interleaved(models, impls: tuple[str, ...], batch: int) -> dict[str, list[float]]:
    """Seconds of each decode in ``ROUNDS`` rounds, each round running every impl once."""
    prompt = prompts(batch)
    for impl in impls:
        run(models, impl, prompt)  # warm-up (and the weight layout for this batch)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(ROUNDS):
        for impl in impls:
            t0 = time.perf_counter()
            run(models, impl, prompt)
            times[impl].append(time.perf_counter() - t0)
    return times


def best_of_interleaved(models, impls: tuple[str, ...], batch: int) -> dict[str, float]:
    return {impl: min(t) for impl, t in interleaved(models, impls, batch).items()}


def test_llmkit_decodes_faster(models):
    """Interleaved runs, best of each: our decode takes less time than transformers'.
    Measured on a 2-core EPYC: 2.3× at the quick size (per-token overhead), 1.25–1.31× at
    GPT-2 small (the decoding weight layout, see
    ``llmkit.inference.layout.COLUMN_MAJOR_ON_CPU``)."""
    best = best_of_interleaved(models, ("llmkit", "transformers"), 1)
    ratio = best["transformers"] / best["llmkit"]
    print(f"\nllmkit {best['llmkit']:.3f}s, transformers {best['transformers']:.3f}s: ×{ratio:.2f}")
    assert ratio > 1.0, best


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("impl", LOW_PRECISION)
def test_low_precision_decodes_twice_as_fast(models, impl, batch):
    """Interleaved runs, best of each: int8 decode (fbgemm w8a8-dynamic on CPU), int8
    weight-only (fbgemm's two digits) and, where the CPU has fast bf16, bf16-weight decode
    against transformers fp32; each ≥ 2× at GPT-2 small where it runs
    (:data:`LOW_PRECISION_SPEEDUP`; docs/benchmarks.md has the figures)."""
    times = interleaved(models, (impl, "llmkit", "transformers"), batch)
    best = {name: min(t) for name, t in times.items()}
    hf, low, fp32 = best["transformers"], best[impl], best["llmkit"]
    rounds = [h / q for h, q in zip(times["transformers"], times[impl])]
    print(
        f"\nbatch {batch}, best of {ROUNDS}: {impl} {low:.3f}s, llmkit fp32 {fp32:.3f}s, "
        f"transformers {hf:.3f}s: {impl} ×{hf / low:.2f}, fp32 ×{hf / fp32:.2f} transformers; "
        f"{impl} per round: median ×{statistics.median(rounds):.2f}, worst ×{min(rounds):.2f}"
    )
    assert hf / low >= LOW_PRECISION_SPEEDUP[impl], best
