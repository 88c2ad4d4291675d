"""Beam search: exactness, a plain reference, normalized scores, EOS hypotheses."""

from __future__ import annotations

import itertools

import pytest
import torch

from llmkit.inference import Sampling, generate_batch
from llmkit.model import build_model
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec


@torch.no_grad()
def _logprob(model, prompt: list[int], ids: list[int]) -> float:
    seq = torch.tensor([prompt + ids])
    logp = model(seq).logits[0].float().log_softmax(-1)
    return sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(ids))


def test_beam_search_is_exact_when_it_keeps_every_prefix():
    """With V² beams over 3 tokens nothing is pruned: the best of all V³ sequences wins."""
    torch.manual_seed(1)
    model = build_model(load_spec_dict(tiny_spec(vocab_size=5, init_std=0.5))).eval()
    prompt = [1, 3]
    best = max(
        (list(seq) for seq in itertools.product(range(5), repeat=3)),
        key=lambda s: _logprob(model, prompt, s),
    )
    cfg = Sampling(max_new_tokens=3, num_beams=25, length_penalty=0.0)
    res = generate_batch(model, [prompt], cfg)[0]
    assert res.ids == best and res.finish_reason == "length"
    assert res.score == pytest.approx(_logprob(model, prompt, best), abs=1e-4)


@torch.no_grad()
def reference_beam_search(model, prompt, k, n, eos, length_penalty, early_stopping):
    """Beam search as in Hugging Face transformers, written plainly (full forwards)."""
    beams = [(0.0, [])]
    done: list[tuple[float, list[int]]] = []
    for step in range(n):
        cands = []
        for score, ids in beams:
            logp = model(torch.tensor([prompt + ids])).logits[0, -1].log_softmax(-1)
            cands += [(score + float(lp), [*ids, t]) for t, lp in enumerate(logp)]
        cands.sort(key=lambda c: c[0], reverse=True)
        beams = []
        for rank, (score, ids) in enumerate(cands[: 2 * k]):
            if ids[-1] == eos:
                if rank < k:
                    done = sorted([*done, (score / len(ids) ** length_penalty, ids)])[::-1][:k]
                continue
            beams.append((score, ids))
            if len(beams) == k:
                break
        if len(done) == k:
            best_running = max(s for s, _ in beams) / (step + 1) ** length_penalty
            if early_stopping or best_running <= done[-1][0]:
                return done[0]
    for score, ids in beams:
        done = sorted([*done, (score / len(ids) ** length_penalty, ids)])[::-1][:k]
    return done[0]


@pytest.mark.parametrize(("early", "length_penalty"), [(True, 1.0), (False, 1.0), (True, 2.0)])
def test_beam_search_with_eos_matches_a_plain_reference(early, length_penalty):
    torch.manual_seed(3)
    model = build_model(load_spec_dict(tiny_spec(vocab_size=6, init_std=0.4))).eval()
    for prompt in ([1, 2], [4], [0, 5, 3]):
        eos = generate_batch(model, [prompt], Sampling(max_new_tokens=2, temperature=0))[0].ids[1]
        want_score, want_ids = reference_beam_search(
            model, prompt, 3, 7, eos, length_penalty, early
        )
        cfg = Sampling(
            max_new_tokens=7,
            num_beams=3,
            eos_id=eos,
            length_penalty=length_penalty,
            early_stopping=early,
        )
        got = generate_batch(model, [prompt], cfg)[0]
        assert got.ids == want_ids
        assert got.score == pytest.approx(want_score, abs=1e-5)


def test_beam_search_beats_greedy_and_reports_normalized_scores(lm):
    prompts = [[1, 2, 3, 4], [9]]
    greedy = generate_batch(lm, prompts, Sampling(max_new_tokens=8, temperature=0))
    beams = generate_batch(lm, prompts, Sampling(max_new_tokens=8, num_beams=4))
    for prompt, g, b in zip(prompts, greedy, beams):
        assert len(b.ids) == 8
        assert b.score == pytest.approx(_logprob(lm, prompt, b.ids) / 8, abs=1e-4)
        assert _logprob(lm, prompt, b.ids) >= _logprob(lm, prompt, g.ids) - 1e-4
    alone = generate_batch(lm, prompts[1:], Sampling(max_new_tokens=8, num_beams=4))[0]
    assert alone.ids == beams[1].ids  # left padding does not change the search


def test_beam_search_finishes_hypotheses_at_eos(lm):
    prompt = [[1, 2, 3]]
    free = generate_batch(lm, prompt, Sampling(max_new_tokens=6, num_beams=3))[0]
    eos = free.ids[1]
    res = generate_batch(lm, prompt, Sampling(max_new_tokens=6, num_beams=3, eos_id=eos))[0]
    assert res.finish_reason in ("eos", "length")
    if res.finish_reason == "eos":
        assert res.ids[-1] == eos and eos not in res.ids[:-1]
    lazy = Sampling(max_new_tokens=6, num_beams=3, eos_id=eos, early_stopping=False)
    assert generate_batch(lm, prompt, lazy)[0].score is not None
