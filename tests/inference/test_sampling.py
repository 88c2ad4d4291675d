"""Sampling settings, logits filters, the repetition penalty, and greedy/sampled decoding."""

from __future__ import annotations

import pytest
import torch

from llmkit.inference import (
    Sampling,
    apply_repetition_penalty,
    filter_logits,
    generate_batch,
    generate_ids,
)
from llmkit.model import build_model
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

# -- logits processing ------------------------------------------------------------------------


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


def test_min_p_keeps_tokens_above_a_fraction_of_the_top_probability():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]]).log_softmax(-1)
    probs = logits.exp()[0]  # ≈ 0.64, 0.24, 0.09, 0.03
    kept = torch.isfinite(filter_logits(logits, None, None, min_p=0.3))
    assert kept.tolist() == [[True, True, False, False]]
    assert probs[1] >= 0.3 * probs[0] > probs[2]
    assert torch.isfinite(filter_logits(logits, None, None, min_p=1.0)).sum() == 1


def test_repetition_penalty_follows_ctrl():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0]]
    assert torch.equal(apply_repetition_penalty(logits, seen, 1.0), logits)


def test_repetition_penalty_changes_greedy_output(lm):
    prompt = [[3, 4, 5]]
    plain = generate_batch(lm, prompt, Sampling(max_new_tokens=20, temperature=0))[0].ids
    assert len(set(plain)) < len(plain)  # a random tiny model repeats itself
    strong = Sampling(max_new_tokens=20, temperature=0, repetition_penalty=1e6)
    penalized = generate_batch(lm, prompt, strong)[0].ids
    assert penalized != plain
    assert len(set(penalized[:10])) == 10 and not set(penalized[:10]) & {3, 4, 5}


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1.0},
        {"top_k": 0},
        {"top_p": 0.0},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"num_beams": 0},
        {"num_beams": 2, "top_k": 5},
        {"max_new_tokens": -1},
        {"stop": [""]},
    ],
)
def test_bad_settings_are_refused(lm, bad):
    with pytest.raises(ValueError):
        generate_batch(lm, [[1]], Sampling(**bad))


# -- greedy and sampling ----------------------------------------------------------------------


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
    c = generate_ids(model, prompt, Sampling(max_new_tokens=40, temperature=1.0, seed=4))
    assert not torch.equal(a, c)


def test_top_k_one_is_greedy_and_filters_restrict_the_sample(lm):
    prompt = [[1, 2, 3]]
    greedy = generate_batch(lm, prompt, Sampling(max_new_tokens=15, temperature=0))[0].ids
    top1 = generate_batch(lm, prompt, Sampling(max_new_tokens=15, top_k=1, seed=0))[0].ids
    assert top1 == greedy
    tiny_p = generate_batch(lm, prompt, Sampling(max_new_tokens=15, top_p=1e-6, seed=0))[0]
    assert tiny_p.ids == greedy
    min_p = generate_batch(lm, prompt, Sampling(max_new_tokens=15, min_p=1.0, seed=5))[0]
    assert min_p.ids == greedy


def test_sampling_follows_the_model_distribution():
    """Many one-token samples: frequencies match softmax(logits / T) (χ²-style bound)."""
    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec(vocab_size=8, init_std=0.5))).eval()
    prompt = [2, 5]
    probs = (model(torch.tensor([prompt])).logits[0, -1] / 0.7).softmax(-1)
    n = 4000
    res = generate_batch(model, [prompt] * n, Sampling(max_new_tokens=1, temperature=0.7, seed=1))
    counts = torch.bincount(torch.tensor([r.ids[0] for r in res]), minlength=8).float()
    expected = probs.detach() * n
    assert float(((counts - expected).abs() / expected.sqrt().clamp(min=1)).max()) < 5


def test_eos_ends_a_row_and_the_others_go_on(lm):
    prompts = [[1, 2, 3], [4, 5]]
    free = generate_batch(lm, prompts, Sampling(max_new_tokens=12, temperature=0))
    ids = free[0].ids
    j = next(j for j, t in enumerate(ids) if j > 0 and t not in ids[:j])
    eos = ids[j]
    res = generate_batch(lm, prompts, Sampling(max_new_tokens=12, temperature=0, eos_id=eos))
    assert res[0].finish_reason == "eos" and res[0].ids == ids[: j + 1]
    if eos not in free[1].ids:
        assert res[1].finish_reason == "length" and res[1].ids == free[1].ids
    ignored = Sampling(max_new_tokens=12, temperature=0, eos_id=eos, ignore_eos=True)
    assert generate_batch(lm, prompts, ignored)[0].ids == free[0].ids
    padded = generate_ids(lm, torch.tensor([[1, 2, 3]]), Sampling(12, temperature=0, eos_id=eos))
    assert padded.shape == (1, j + 1)


@pytest.mark.parametrize("beams", [1, 2])
def test_the_repetition_penalty_covers_the_whole_prompt(beams):
    # A prompt longer than max_seq_len: the model sees its last 16 ids, the penalty all 17.
    torch.manual_seed(0)
    spec = tiny_spec(position={"name": "rope"}, max_seq_len=16, init_std=0.3)
    model = build_model(load_spec_dict(spec)).eval()
    for start in range(40):  # a context whose favourite next id is not in it
        ctx = list(range(start + 1, start + 17))
        with torch.no_grad():
            favourite = int(model(torch.tensor([ctx])).logits[0, -1].argmax())
        if favourite not in ctx:
            break
    cfg = Sampling(max_new_tokens=1, temperature=0, num_beams=beams, ignore_eos=True)
    (plain,) = generate_batch(model, [[favourite, *ctx]], cfg)
    assert plain.ids == [favourite]
    cfg.repetition_penalty = 1000.0
    (penalized,) = generate_batch(model, [[favourite, *ctx]], cfg)
    assert penalized.ids != [favourite]
