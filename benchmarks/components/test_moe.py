"""Mixture-of-experts forward+backward time: the sorted-segment dispatch of ``ffn.moe``
against a dense SwiGLU with the same active parameters (hidden top_k·h) and against the
plain masked loop that runs every expert on every token (the tests' reference).

Quick shapes by default; ``LLMKIT_BENCH=full`` for larger ones. Run
``pytest benchmarks/components/test_moe.py`` (``--benchmark-disable`` only checks that it
runs). CPU, one thread (see ``_one_thread``).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.conftest import FULL
from llmkit.components.ffn.moe import MoE, MoEOptions
from llmkit.components.ffn.swiglu import SwiGLU, SwiGLUOptions
from llmkit.contracts import BuildContext
from tests.components.test_moe import reference_moe

D_MODEL = 256 if FULL else 64
TOKENS = [1024, 4096, 16384] if FULL else [128, 512]
EXPERTS = [8, 32] if FULL else [4, 8]
TOP_K = 2
HIDDEN = 2 * D_MODEL  # per expert; the dense twin has TOP_K · HIDDEN


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One CPU thread: the MoE issues many more (smaller) parallel regions than the dense
    block, so on a machine shared with other jobs multi-threaded timings measure OpenMP
    contention rather than the dispatch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _ctx() -> BuildContext:
    return BuildContext(
        d_model=D_MODEL, n_heads=4, n_kv_heads=4, head_dim=D_MODEL // 4, max_seq_len=16384,
        n_layers=1, bias=False,
    )  # fmt: skip


def _build(impl: str, experts: int):
    torch.manual_seed(0)
    if impl == "dense":
        module = SwiGLU(SwiGLUOptions(hidden=TOP_K * HIDDEN), _ctx())
        return module, module
    moe = MoE(
        MoEOptions(num_experts=experts, top_k=TOP_K, expert={"name": "swiglu", "hidden": HIDDEN}),
        _ctx(),
    )
    moe.init_weights(0.5)  # a decisive router: uneven segments, as after training
    if impl == "loop":
        return moe, lambda x: reference_moe(moe, x)[0]
    return moe, moe


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("impl", ["moe", "dense", "loop"])
def test_moe_forward_backward(benchmark, impl, experts, tokens):
    if impl == "dense" and experts != EXPERTS[0]:
        pytest.skip("the dense twin does not depend on the expert count")
    if impl == "loop" and tokens > 4096:
        pytest.skip("the loop costs E/k dense blocks; smaller shapes make the point")
    module, fn = _build(impl, experts)
    x = torch.randn(1, tokens, D_MODEL, requires_grad=True)
    active = sum(p.numel() for p in module.parameters())
    if isinstance(module, MoE):
        active = module.active_parameters()

    def step():
        module.zero_grad(set_to_none=True)
        out = fn(x)
        out.sum().backward()
        if isinstance(module, MoE):
            module.pop_side_outputs()
        return out

    out = benchmark(step)
    assert out.shape == x.shape and torch.isfinite(out).all()
    benchmark.extra_info["active_params"] = active
    if benchmark.stats:
        benchmark.extra_info["tokens/s"] = tokens / benchmark.stats.stats.median
