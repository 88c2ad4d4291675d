"""Log-likelihood scoring: the lm-eval-harness token split, batching, the KV-cache path for
shared contexts, truncation, and whole-text (rolling) scores."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from llmkit.data.tokenizer import train_char
from llmkit.evaluation import LoglikScorer, TokenRequest
from llmkit.evaluation.perplexity import evaluate_batches, sliding_batches
from llmkit.model import build_model
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

TEXT = "the quick brown fox jumps over the lazy dog. "
PAIRS = [
    ("the quick", " brown"),
    ("the quick", " fox jumps"),
    ("the quick", " d"),
    ("a lazy", " dog"),
    ("a lazy", " fox."),
    ("", "the"),
    ("over the lazy dog ", "the"),  # trailing space moves to the continuation
    (TEXT * 3, "over"),  # longer than the model's context: cut from the left
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs on one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def tok():
    return train_char([TEXT], special_tokens=["<|endoftext|>"])


def model_for(tok, **model) -> torch.nn.Module:
    torch.manual_seed(0)
    spec = tiny_spec(vocab_size=tok.vocab_size, max_seq_len=48, init_std=0.2, **model)
    return build_model(load_spec_dict(spec)).eval()


@torch.no_grad()
def reference(model, req: TokenRequest, max_length: int) -> tuple[float, bool]:
    """One request alone, the plain way: the last max_length + 1 tokens, one forward."""
    ids = list(req.context + req.continuation)[-(max_length + 1) :]
    logp = F.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].float(), -1)
    n = len(req.continuation)
    rows = logp[len(ids) - 1 - n :]
    target = torch.tensor(req.continuation)
    return float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


MODELS = {
    "rope": {"position": {"name": "rope"}},
    "learned": {"position": {"name": "learned"}},
    "alibi": {"position": {"name": "alibi"}},
    "sliding_window": {
        "position": {"name": "rope"},
        "attention": {"name": "sliding_window", "window": 8},
    },
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_path_matches_scoring_each_request_alone(tok, kind):
    model = model_for(tok, **MODELS[kind])
    cached = LoglikScorer(model, tok, batch_size=3)
    full = LoglikScorer(model, tok, batch_size=5, use_cache=False)
    assert cached.use_cache and not full.use_cache
    got_cached, got_full = cached.loglikelihood(PAIRS), full.loglikelihood(PAIRS)
    for pair, a, b in zip(PAIRS, got_cached, got_full):
        req = cached.encode_pair(*pair)
        logprob, greedy = reference(model, req, 48)
        assert a.tokens == b.tokens == len(req.continuation)
        assert a.logprob == pytest.approx(logprob, abs=1e-4)
        assert b.logprob == pytest.approx(logprob, abs=1e-4)
        assert a.greedy == b.greedy == greedy


def test_the_context_is_split_as_lm_eval_harness_splits_it(tok):
    scorer = LoglikScorer(model_for(tok), tok)
    req = scorer.encode_pair("over the lazy  ", "dog")
    assert req.context == tuple(tok.encode("over the lazy"))
    assert req.continuation == tuple(tok.encode("  dog"))
    empty = scorer.encode_pair("", "the")
    assert empty.context == (tok.eos_id,) and empty.continuation == tuple(tok.encode("the"))


def test_bad_requests_are_errors(tok):
    scorer = LoglikScorer(model_for(tok), tok)
    with pytest.raises(ValueError, match="empty continuation"):
        scorer.loglikelihood([("the", "")])
    with pytest.raises(ValueError, match="longer than the model's context"):
        scorer.loglikelihood([("the", " quick" * 20)])
    no_eos = SimpleNamespace(eos_id=None, encode=tok.encode)
    with pytest.raises(ValueError, match="document-start token"):
        LoglikScorer(model_for(tok), no_eos).loglikelihood([("", "the")])


def test_scores_come_back_in_request_order(tok):
    scorer = LoglikScorer(model_for(tok), tok, batch_size=2)
    alone = [scorer.loglikelihood([p])[0] for p in PAIRS]
    together = scorer.loglikelihood(PAIRS[::-1])[::-1]
    for a, b in zip(alone, together):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.tokens == b.tokens


def test_rolling_scores_every_token_once(tok):
    model = model_for(tok, position={"name": "rope"})
    scorer = LoglikScorer(model, tok, batch_size=4)
    short = "the quick brown"
    assert scorer.rolling(short).logprob == pytest.approx(
        scorer.loglikelihood([("", short)])[0].logprob, abs=1e-4
    )
    long = TEXT * 4
    ids = [tok.eos_id, *tok.encode(long)]
    disjoint, sliding = scorer.rolling(long), scorer.rolling(long, stride=12)
    assert disjoint.tokens == sliding.tokens == len(ids) - 1
    assert disjoint.logprob != pytest.approx(sliding.logprob, abs=1e-3)  # more context
    # the same windows through the perplexity evaluator
    for stride, got in ((48, disjoint), (12, sliding)):
        res = evaluate_batches(
            model, sliding_batches(torch.tensor(ids), 48, stride, 4), torch.device("cpu")
        )
        assert res.tokens == got.tokens
        assert -res.loss * res.tokens == pytest.approx(got.logprob, rel=1e-5)
