"""Our scorer against lm-eval-harness's own ``hf`` model on the same weights: a GPT-2-style
llmkit model copied into ``GPT2LMHeadModel`` and a byte-level BPE tokenizer handed to both.
Equal log-likelihoods and greedy flags prove the context/continuation token split, the
left truncation and the rolling windows are lm-eval-harness's."""

from __future__ import annotations

import os

import pytest
import torch

from llmkit.data.tokenizer import train_bpe
from llmkit.evaluation import LoglikScorer
from llmkit.model import build_model
from llmkit.spec import load_spec_dict
from tests.hf_gpt2 import gpt2_spec, to_hf_gpt2

pytest.importorskip("accelerate")  # lm-eval's hf model needs it (the dev extra has it)
transformers = pytest.importorskip("transformers")
huggingface = pytest.importorskip("lm_eval.models.huggingface")
from lm_eval.api.instance import Instance  # noqa: E402

CORPUS = [
    "the quick brown fox jumps over the lazy dog. " * 3,
    "def f(x):\n    return x + 1\n",
    "Question: what is it?\nAnswer: a dog",
] * 20
BASE = "the quick brown fox jumps over the lazy dog. "
PAIRS = [
    ("the quick", " brown"),
    ("the quick", " fox jumps"),  # three choices of one context: the KV-cache path
    ("the quick", " lazy dog."),
    ("the quick brown ", "fox jumps"),  # trailing space moves to the continuation
    ("Question: what is it?\nAnswer:", " a dog"),
    ("", "the lazy dog"),  # empty context: the EOS starts the document
    (BASE * 4, "the"),  # longer than the context: cut from the left
    (BASE * 4, "the quick"),
    ("def f(x):\n   ", " return x"),
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs on one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def models(monkeypatch_module=None):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = train_bpe(CORPUS, vocab_size=300, special_tokens=["<|endoftext|>"])
    torch.manual_seed(0)
    ours = build_model(load_spec_dict(gpt2_spec(64, 2, 4, tok.vocab_size, 48))).eval()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token="<|endoftext|>")
    theirs = huggingface.HFLM(
        pretrained=to_hf_gpt2(ours), tokenizer=fast, device="cpu", batch_size=4, max_length=48
    )
    return ours, tok, theirs


def requests(kind: str, args: list[tuple]) -> list:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def test_loglikelihoods_equal_lm_eval_harness(models):
    ours, tok, theirs = models
    expected = theirs.loglikelihood(requests("loglikelihood", PAIRS))
    for use_cache in (True, False):
        got = LoglikScorer(ours, tok, batch_size=3, use_cache=use_cache).loglikelihood(PAIRS)
        for pair, (logprob, greedy), mine in zip(PAIRS, expected, got):
            assert mine.logprob == pytest.approx(logprob, abs=1e-4), pair
            assert mine.greedy == greedy, pair


def test_rolling_loglikelihoods_equal_lm_eval_harness(models):
    ours, tok, theirs = models
    texts = [BASE * 5, "Question: what is it?", BASE * 12 + "def f(x):"]
    expected = theirs.loglikelihood_rolling(
        requests("loglikelihood_rolling", [(t,) for t in texts])
    )
    scorer = LoglikScorer(ours, tok, batch_size=2)
    for text, logprob in zip(texts, expected):
        assert scorer.rolling(text).logprob == pytest.approx(logprob, abs=1e-3)
