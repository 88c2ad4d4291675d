"""Training-step throughput (tokens/s, MFU) of the example specs on CPU, and our step side by
side with a plain-PyTorch GPT trainer of the same model (``benchmarks/reference_gpt.py``,
nanoGPT's documented model and loop) in one pytest-benchmark group.

Quick mode shrinks every spec to one layer and a short sequence so CI exercises the code;
``LLMKIT_BENCH=full`` measures the specs as written (batch and context from the spec) and
the baby GPT (6 layers, width 384, context 256, batch 16) side by side.
"""

from __future__ import annotations

import pytest

from benchmarks import reference_gpt
from benchmarks.conftest import FULL
from llmkit.bench import build_training_step, time_training_step
from llmkit.spec import load_spec
from tests.conftest import SPECS

CPU_SPECS = ["tiny.toml", "shakespeare-char.toml", "baby-gpt.toml"]


def _spec(name: str):
    quick = (
        []
        if FULL
        else ["model.n_layers=1", "model.max_seq_len=32", "model.d_model=64", "model.n_heads=2"]
    )
    rs = load_spec(SPECS / name, quick)
    batch = rs.spec.train.batch_size if FULL else 2
    seq = rs.spec.data.block_size or rs.model.max_seq_len
    return rs, batch, seq


@pytest.mark.parametrize("name", CPU_SPECS)
def test_training_step(benchmark, name):
    rs, batch, seq = _spec(name)
    step, model = build_training_step(rs, batch, seq, "auto")
    loss = benchmark(step)
    assert loss == loss  # finite, not NaN
    if benchmark.stats:
        median = benchmark.stats.stats.median
        benchmark.extra_info["tokens_per_s"] = batch * seq / median
        benchmark.extra_info["GFLOP/s"] = (
            model.flops_per_token(seq)["train"] * batch * seq / median / 1e9
        )


@pytest.mark.parametrize("name", CPU_SPECS[:1])
def test_time_training_step_reports_mfu(name):
    rs, batch, seq = _spec(name)
    timing = time_training_step(rs, batch, seq, repeats=2)
    assert timing.tokens_per_s > 0 and timing.mfu is not None and 0 < timing.mfu < 1.5


def _side_by_side():
    """Our baby-GPT spec and the plain-PyTorch recipe of the same model and batch."""
    rs, batch, seq = _spec("baby-gpt.toml")
    shape = (
        reference_gpt.BABY_GPT
        if FULL
        else {
            "n_layer": 1,
            "n_head": 2,
            "n_embd": 64,
            "block_size": 32,
            "batch_size": 2,
            "dropout": 0.2,
        }
    )
    recipe = reference_gpt.Recipe(**shape)
    assert (recipe.batch_size, recipe.block_size) == (batch, seq)
    return rs, batch, seq, recipe


def test_side_by_side_models_are_the_same_size():
    rs, _, _, recipe = _side_by_side()
    ours = build_training_step(rs, 1, 8, "fp32")[1]
    theirs = reference_gpt.build_step(recipe, rs.model.vocab_size)[1]
    assert ours.num_params() == sum(p.numel() for p in theirs.parameters())


@pytest.mark.benchmark(group="train-step-vs-plain-pytorch")
@pytest.mark.parametrize("impl", ["llmkit", "plain-pytorch"])
def test_training_step_side_by_side(benchmark, impl):
    rs, batch, seq, recipe = _side_by_side()
    if impl == "llmkit":
        step, model = build_training_step(rs, batch, seq, "auto")
        flops = model.flops_per_token(seq)["train"]
    else:
        step, model = reference_gpt.build_step(recipe, rs.model.vocab_size)
        flops = model.flops_per_token(seq, recipe)
    for _ in range(2):
        step()  # warm-up: first-touch allocations, oneDNN primitive caches
    loss = benchmark.pedantic(step, rounds=5 if FULL else 10, warmup_rounds=0)
    assert loss == loss
    if benchmark.stats:
        median = benchmark.stats.stats.median
        benchmark.extra_info["tokens_per_s"] = batch * seq / median
        benchmark.extra_info["GFLOP/s"] = flops * batch * seq / median / 1e9
