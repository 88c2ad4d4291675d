"""Multiple-choice scoring with and without the KV cache for shared contexts.

HellaSwag-shaped items: a long context and four short endings. Through the cache each
context is fed once and only the endings four times; the full path feeds context + ending
for every choice. Both give the same scores (tests/evaluation/test_loglik.py); this times
them side by side in one pytest-benchmark group.

Quick mode: the tiny demo model's shape with 8 items; ``LLMKIT_BENCH=full``: 64 items.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.conftest import FULL
from llmkit.evaluation import LoglikScorer, TokenRequest
from llmkit.model import build_model
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

ITEMS, CONTEXT, ENDING, CHOICES = (64 if FULL else 8), 192, 12, 4


@pytest.fixture(scope="module")
def setup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = tiny_spec(
        vocab_size=4096, d_model=192, n_layers=4, n_heads=6, max_seq_len=256,
        position={"name": "rope"},
    )  # fmt: skip
    model = build_model(load_spec_dict(spec)).eval()
    g = torch.Generator().manual_seed(1)
    requests = []
    for _ in range(ITEMS):
        ctx = tuple(torch.randint(0, 4096, (CONTEXT,), generator=g).tolist())
        for _ in range(CHOICES):
            ending = tuple(torch.randint(0, 4096, (ENDING,), generator=g).tolist())
            requests.append(TokenRequest(ctx, ending))
    yield model, requests
    torch.set_num_threads(threads)


@pytest.mark.benchmark(group="multiple-choice-scoring")
@pytest.mark.parametrize("path", ["kv-cache", "full-forward"])
def test_score_multiple_choice(benchmark, setup, path):
    model, requests = setup
    scorer = LoglikScorer(model, None, batch_size=16, use_cache=path == "kv-cache")
    scores = benchmark(scorer.score, requests)
    assert len(scores) == len(requests) and all(s.tokens == ENDING for s in scores)
    benchmark.extra_info["tokens_fed"] = (
        ITEMS * (CONTEXT + CHOICES * (ENDING - 1))
        if path == "kv-cache"
        else ITEMS * CHOICES * (CONTEXT + ENDING - 1)
    )
