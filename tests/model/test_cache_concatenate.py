"""``KVCache.concatenate`` and ``KVCache.select``: rows prefilled apart continue in one batch
exactly as they would alone, and rows that leave take their columns with them."""

from __future__ import annotations

import pytest
import torch

from llmkit.model import KVCache, build_model
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [3] * 11]


@pytest.mark.parametrize(
    "model",
    [
        {"position": {"name": "rope"}},
        {"position": {"name": "alibi"}, "attention": {"name": "sliding_window", "window": 4}},
        {"position": {"name": "learned"}, "n_kv_heads": 1},
    ],
    ids=["rope", "alibi-window", "learned-mqa"],
)
def test_rows_prefilled_apart_decode_together_as_alone(model) -> None:
    torch.manual_seed(0)
    lm = build_model(load_spec_dict(tiny_spec(vocab_size=50, max_seq_len=64, **model))).eval()
    with torch.no_grad():
        alone, firsts = [], []
        for p in PROMPTS:
            cache = lm.new_cache()
            firsts.append(int(lm(torch.tensor([p]), cache=cache).logits[0, -1].argmax()))
            alone.append(cache)
        batch = KVCache.concatenate(alone)
        assert batch.rows == 3 and batch.seen.tolist() == [len(p) for p in PROMPTS]
        out = lm(torch.tensor(firsts)[:, None], cache=batch).logits[:, -1]
        for i, (p, f) in enumerate(zip(PROMPTS, firsts)):
            cache = lm.new_cache()
            lm(torch.tensor([p]), cache=cache)
            ref = lm(torch.tensor([[f]]), cache=cache).logits[0, -1]
            torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
        # the longest row leaves: the columns only it held are dropped
        before = batch.layers[0].length
        batch.select(torch.tensor([0, 1]))
        assert batch.rows == 2
        if "attention" not in model:  # (a window keeps its last 4 keys either way)
            assert batch.layers[0].length == len(PROMPTS[0]) + 1 < before
        nxt = lm(torch.tensor([[5], [6]]), cache=batch).logits[:, -1]
        for i, (p, f, t) in enumerate(zip(PROMPTS[:2], firsts, [5, 6])):
            cache = lm.new_cache()
            lm(torch.tensor([[*p, f]]), cache=cache)
            ref = lm(torch.tensor([[t]]), cache=cache).logits[0, -1]
            torch.testing.assert_close(nxt[i], ref, atol=1e-5, rtol=1e-5)


def test_concatenate_refuses_nothing_and_empty_caches() -> None:
    torch.manual_seed(0)
    lm = build_model(load_spec_dict(tiny_spec(vocab_size=50, max_seq_len=64))).eval()
    with pytest.raises(ValueError, match="nothing"):
        KVCache.concatenate([])
    with pytest.raises(ValueError, match="hold keys"):
        KVCache.concatenate([lm.new_cache()])
