"""Training-step throughput (tokens/s, MFU) of the example specs on CPU.

Quick mode shrinks every spec to one layer and a short sequence so CI exercises the code;
``LLMKIT_BENCH=full`` measures the specs as written (batch and context from the spec).
"""

from __future__ import annotations

import pytest

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
