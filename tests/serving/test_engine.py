"""The continuous-batching engine, stepped by hand: requests that join a running batch at
different steps, chunked prompts, batch bounds, cancellation and errors each give every
request what ``llmkit generate`` gives it alone, and free the batch's rows."""

from __future__ import annotations

import pytest
import torch

from llmkit.data.tokenizer import train_char
from llmkit.inference import Generator
from llmkit.model import build_model
from llmkit.serving import Engine, Event, Request, SamplingParams
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

CORPUS = "the quick brown fox jumps over the lazy dog.\n" * 3
PROMPTS = ["the quick", "lazy", "a fox jumps over the", "dog"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny tensors: one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def tok():
    return train_char([CORPUS])


def _model(tok, **model):
    torch.manual_seed(0)
    spec = tiny_spec(vocab_size=tok.vocab_size, max_seq_len=64, init_std=0.2, **model)
    return build_model(load_spec_dict(spec)).eval()


@pytest.fixture(scope="module")
def lm(tok):
    return _model(tok, position={"name": "rope"})


class Sink:
    """A request's events, as the engine emits them."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def ids(self, index: int = 0) -> list[int]:
        return [t.id for e in self.events if e.index == index for t in e.tokens]

    def text(self, index: int = 0) -> str:
        return "".join(e.text for e in self.events if e.index == index)

    def reason(self, index: int = 0) -> str | None:
        ends = [e.finish_reason for e in self.events if e.index == index and e.finish_reason]
        assert len(ends) <= 1
        return ends[0] if ends else None


def _submit(engine: Engine, tok, prompt: str, n: int = 1, **params) -> Sink:
    sink = Sink()
    params.setdefault("max_tokens", 12)
    engine.submit(Request(tok.encode(prompt), SamplingParams(**params), sink, n))
    return sink


def _drain(engine: Engine, limit: int = 500) -> None:
    for _ in range(limit):
        if engine.idle:
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def _greedy(lm, tok, prompt: str, n: int = 12, **kw) -> list[int]:
    return Generator(lm, tok).generate(prompt, temperature=0, max_new_tokens=n, **kw)[0].ids


@pytest.mark.parametrize(
    "model",
    [
        {"position": {"name": "rope"}},
        {"position": {"name": "learned"}},
        {"position": {"name": "alibi"}, "attention": {"name": "sliding_window", "window": 5}},
    ],
    ids=["rope", "learned", "alibi-window"],
)
def test_requests_joining_at_different_steps_get_their_greedy_tokens(tok, model) -> None:
    lm = _model(tok, **model)
    engine = Engine(lm, tok, max_batch=8)
    sinks = []
    for i, prompt in enumerate(PROMPTS):  # one more request every three steps
        sinks.append(_submit(engine, tok, prompt, temperature=0, ignore_eos=True, max_tokens=12))
        for _ in range(3 * (i < len(PROMPTS) - 1)):
            engine.step()
    _drain(engine)
    for prompt, sink in zip(PROMPTS, sinks):
        assert sink.ids() == _greedy(lm, tok, prompt, ignore_eos=True), prompt
        assert sink.reason() == "length"
    assert engine.peak_rows == len(PROMPTS)  # all four decoded in one batch at some step
    assert engine.stats() == {"waiting": 0, "running": 0, "kv_cache_bytes": 0}


def test_long_prompts_are_fed_in_chunks_while_the_batch_decodes(lm, tok) -> None:
    engine = Engine(lm, tok, max_batch=4, prefill_tokens=3)
    short = _submit(engine, tok, "dog", temperature=0, ignore_eos=True, max_tokens=20)
    engine.step()
    engine.step()
    long_prompt = "a fox jumps over the lazy dog"
    long = _submit(engine, tok, long_prompt, temperature=0, ignore_eos=True, max_tokens=6)
    before = len(short.ids())
    engine.step()
    engine.step()
    assert not long.events  # its prompt is still being fed, three tokens a step
    assert len(short.ids()) == before + 2  # the running request kept decoding meanwhile
    _drain(engine)
    assert long.ids() == _greedy(lm, tok, long_prompt, 6, ignore_eos=True)
    assert short.ids() == _greedy(lm, tok, "dog", 20, ignore_eos=True)


def test_the_batch_holds_at_most_max_batch_choices_in_arrival_order(lm, tok) -> None:
    engine = Engine(lm, tok, max_batch=2)
    sinks = [_submit(engine, tok, p, temperature=0, ignore_eos=True, max_tokens=5) for p in PROMPTS]
    first_token_at: list[int] = [0] * len(sinks)
    steps = 0
    while not engine.idle:
        engine.step()
        steps += 1
        for i, s in enumerate(sinks):
            if s.ids() and not first_token_at[i]:
                first_token_at[i] = steps
    assert engine.peak_rows == 2
    assert first_token_at == sorted(first_token_at)  # no request overtook an earlier one
    for prompt, sink in zip(PROMPTS, sinks):
        assert sink.ids() == _greedy(lm, tok, prompt, 5, ignore_eos=True)
    bad = Request(tok.encode("dog"), SamplingParams(max_tokens=3), Sink(), n=3)
    with pytest.raises(ValueError, match="batch of 2"):
        engine.submit(bad)


def test_a_cancelled_request_leaves_the_batch_and_frees_its_rows(lm, tok) -> None:
    engine = Engine(lm, tok, max_batch=4)
    keep = _submit(engine, tok, "the quick", temperature=0, ignore_eos=True, max_tokens=15)
    gone = Sink()
    request = Request(tok.encode("lazy"), SamplingParams(max_tokens=40, ignore_eos=True), gone)
    engine.submit(request)
    for _ in range(3):
        engine.step()
    assert engine.stats()["running"] == 2
    request.cancel()
    engine.step()
    assert engine.stats()["running"] == 1
    count = len(gone.events)
    _drain(engine)
    assert len(gone.events) == count  # nothing more after the cancel
    assert keep.ids() == _greedy(lm, tok, "the quick", 15, ignore_eos=True)
    assert engine.stats()["kv_cache_bytes"] == 0
    waiting = Request(tok.encode("dog"), SamplingParams(max_tokens=4), Sink())
    engine.submit(waiting)
    waiting.cancel()
    engine.step()
    assert engine.idle and not waiting.emit.events  # cancelled before it started


def test_seeded_choices_draw_their_own_streams(lm, tok) -> None:
    engine = Engine(lm, tok, max_batch=4)
    kw = {"temperature": 0.9, "top_k": 5, "seed": 7, "ignore_eos": True, "max_tokens": 15}
    both = _submit(engine, tok, "the quick", n=3, **kw)
    other = _submit(engine, tok, "lazy", temperature=1.0, ignore_eos=True, max_tokens=15)
    _drain(engine)
    gen = Generator(lm, tok)
    ref = gen.generate(
        "the quick", temperature=0.9, top_k=5, seed=7, max_new_tokens=15, ignore_eos=True
    )[0]
    assert both.ids(0) == ref.ids  # choice 0 of seed s draws what llmkit generate draws
    ref2 = gen.generate(
        "the quick", temperature=0.9, top_k=5, seed=8, max_new_tokens=15, ignore_eos=True
    )[0]
    assert both.ids(1) == ref2.ids  # choice i: seed s + i
    assert len({tuple(both.ids(i)) for i in range(3)}) > 1
    assert len(other.ids()) == 15


def test_stop_strings_and_stop_ids_end_a_choice(lm, tok) -> None:
    engine = Engine(lm, tok)
    free = _submit(engine, tok, "the quick", temperature=0, ignore_eos=True, max_tokens=12)
    _drain(engine)
    text = free.text()
    stop = text[3:5]
    cut = _submit(engine, tok, "the quick", temperature=0, stop=(stop,), max_tokens=12)
    third = free.ids()[2]
    by_id = _submit(
        engine, tok, "the quick", temperature=0, max_tokens=12, stop_ids=frozenset({third})
    )
    _drain(engine)
    assert cut.reason() == "stop" and cut.text() == text[: text.index(stop)]
    assert by_id.reason() == "stop" and by_id.ids() == free.ids()[:3]
    assert stop not in cut.text()
    # a stop id is not text; ignore_eos decodes past it
    assert by_id.text() == tok.decode(free.ids()[:2])
    past = _submit(
        engine,
        tok,
        "the quick",
        temperature=0,
        max_tokens=12,
        ignore_eos=True,
        stop_ids=frozenset({third}),
    )
    _drain(engine)
    assert past.ids() == free.ids()


def test_logprobs_are_the_models_and_echo_scores_the_prompt(lm, tok) -> None:
    engine = Engine(lm, tok, prefill_tokens=4)  # the prompt's scores cross chunks
    prompt = "a fox jumps over"
    sink = _submit(
        engine,
        tok,
        prompt,
        temperature=0,
        ignore_eos=True,
        max_tokens=5,
        logprobs=3,
        prompt_logprobs=True,
    )
    _drain(engine)
    ids = tok.encode(prompt) + sink.ids()
    with torch.no_grad():
        ref = torch.log_softmax(lm(torch.tensor([ids])).logits[0].float(), -1)
    shown = sink.events[0].prompt
    assert shown is not None and [t.id for t in shown] == tok.encode(prompt)
    assert shown[0].logprob is None
    for j, t in enumerate(shown[1:], start=1):
        assert t.logprob == pytest.approx(float(ref[j - 1, t.id]), abs=1e-4)
        assert len(t.top) == 3
    new = [t for e in sink.events for t in e.tokens]
    p = len(tok.encode(prompt))
    for j, t in enumerate(new):
        assert t.logprob == pytest.approx(float(ref[p - 1 + j, t.id]), abs=1e-4)
        assert t.top[0][0] == t.id  # greedy: the chosen token is the most likely
    echo_only = _submit(engine, tok, prompt, max_tokens=0, logprobs=0, prompt_logprobs=True)
    _drain(engine)
    assert echo_only.reason() == "length" and echo_only.ids() == []


def test_logit_bias_and_penalties_steer_the_choice(lm, tok) -> None:
    engine = Engine(lm, tok)
    target = tok.encode("z")[0]
    biased = _submit(
        engine,
        tok,
        "the quick",
        temperature=0,
        ignore_eos=True,
        max_tokens=6,
        logit_bias=((target, 100.0),),
    )
    rep = _submit(
        engine,
        tok,
        "the quick",
        temperature=0,
        ignore_eos=True,
        max_tokens=12,
        repetition_penalty=1.5,
    )
    freq = _submit(
        engine,
        tok,
        "the quick",
        temperature=0,
        ignore_eos=True,
        max_tokens=12,
        frequency_penalty=2.0,
    )
    _drain(engine)
    assert biased.ids() == [target] * 6
    assert rep.ids() == _greedy(lm, tok, "the quick", ignore_eos=True, repetition_penalty=1.5)
    plain = _greedy(lm, tok, "the quick", ignore_eos=True)
    assert max(plain.count(t) for t in plain) > max(freq.ids().count(t) for t in freq.ids())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(Request([1], SamplingParams(3, logit_bias=((10**6, 1.0),)), Sink()))


def test_a_failing_step_fails_the_requests_in_flight_and_the_engine_goes_on(tok) -> None:
    lm = _model(tok, position={"name": "rope"})
    engine = Engine(lm, tok)
    first = _submit(engine, tok, "the quick", ignore_eos=True, max_tokens=10)
    engine.step()
    saved = lm.lm_head.weight.detach().clone()
    with torch.no_grad():
        lm.lm_head.weight.fill_(float("nan"))
    engine.step()
    assert first.events[-1].error is not None and "NaN" in first.events[-1].error
    assert engine.stats()["running"] == 0
    with torch.no_grad():
        lm.lm_head.weight.copy_(saved)
    after = _submit(engine, tok, "dog", temperature=0, ignore_eos=True, max_tokens=4)
    _drain(engine)
    assert after.ids() == _greedy(lm, tok, "dog", 4, ignore_eos=True)


def test_requests_the_engine_cannot_run_are_refused(lm, tok) -> None:
    engine = Engine(lm, tok)
    for prompt, params, match in [
        ([], SamplingParams(3), "no tokens"),
        ([tok.vocab_size + 5], SamplingParams(3), "outside the model's vocabulary"),
        ([1], SamplingParams(3, temperature=-1.0), "temperature"),
        ([1], SamplingParams(3, top_p=0.0), "top_p"),
        ([1], SamplingParams(3, logprobs=50), "logprobs"),
        ([1], SamplingParams(3, presence_penalty=3.0), "presence_penalty"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.submit(Request(prompt, params, Sink()))
    assert engine.idle
