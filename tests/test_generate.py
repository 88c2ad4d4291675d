"""Sampling helpers and generation past the context length."""

from __future__ import annotations

import torch

from llmkit.generate import Sampling, filter_logits, generate_ids
from llmkit.model import build_model
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    kept = torch.isfinite(filter_logits(logits, 2, None))
    assert kept.tolist() == [[True, True, False, False]]
    probs = logits.softmax(-1)[0]  # ≈ 0.64, 0.24, 0.09, 0.03
    kept = torch.isfinite(filter_logits(logits, None, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert probs[0] < 0.7 < probs[0] + probs[1]
    kept = torch.isfinite(filter_logits(logits, None, 0.5))
    assert kept.tolist() == [[True, False, False, False]]


def test_greedy_generation_matches_argmax_of_full_forward():
    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec(position={"name": "rope"}))).eval()
    prompt = torch.randint(0, 64, (1, 5))
    new = generate_ids(model, prompt, Sampling(max_new_tokens=6, temperature=0))
    seq = prompt
    for _ in range(6):
        nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(new, seq[:, 5:])


def test_generation_goes_past_max_seq_len_and_seed_reproduces():
    model = build_model(load_spec_dict(tiny_spec(max_seq_len=16))).eval()  # learned positions
    prompt = torch.randint(0, 64, (2, 10))
    cfg = Sampling(max_new_tokens=40, temperature=1.0, top_k=10, seed=3)
    a, b = generate_ids(model, prompt, cfg), generate_ids(model, prompt, cfg)
    assert a.shape == (2, 40) and torch.equal(a, b)
