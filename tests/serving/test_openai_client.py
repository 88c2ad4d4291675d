"""``llmkit serve`` through the official ``openai`` client: completions (greedy equal to
``llmkit generate``, also in a shared batch; streaming; seeded sampling; several choices
and prompts; stop strings; logprobs and echo), chat completions on a tiny trained chat run,
and the model list."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import torch

from llmkit import cli
from llmkit.inference import Generator
from llmkit.runs import load_run
from llmkit.serving.loading import load_served
from tests.serving.serve_helpers import Delay, serving, wait_idle

PROMPTS = ["t", "the quick", "the quick brown fox jumps", "lazy dog.\n the"]


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def delay(lm):
    hook = Delay(lm)
    yield hook
    hook.remove()


@pytest.fixture(scope="module")
def server(lm, char_tok, delay):
    """The random tiny model as "tiny": a batch of 8 choices, prompts fed 8 tokens a step
    (the longer ones in chunks)."""
    with serving(lm, char_tok, name="tiny", max_batch=8, prefill_tokens=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return client_for(server.url)


@pytest.fixture(scope="module")
def gen(lm, char_tok) -> Generator:
    return Generator(lm, char_tok)


def pieces(tok: Any, ids: list[int]) -> list[str]:
    """Each token's own text, as the API's logprobs name tokens."""
    return [tok.decode([i]) for i in ids]


def model_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """log p(ids[j] | ids[:j]) for j ≥ 1, by one forward pass without a cache."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


# -- completions ---------------------------------------------------------------------------


def test_greedy_completion_equals_generate(client, gen, char_tok) -> None:
    n = 10
    for prompt in PROMPTS[:2]:
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        want = gen.generate(prompt, temperature=0, max_new_tokens=n, ignore_eos=True)[0]
        assert out.object == "text_completion" and out.model == "tiny"
        (choice,) = out.choices
        assert choice.index == 0 and choice.finish_reason == "length"
        assert choice.text == want.text
        assert choice.logprobs.tokens == pieces(char_tok, want.ids)
        assert out.usage.prompt_tokens == len(char_tok.encode(prompt))
        assert out.usage.completion_tokens == n
        assert out.usage.total_tokens == out.usage.prompt_tokens + n


def test_concurrent_requests_share_a_batch_and_equal_generate(
    server, client, gen, char_tok, delay
) -> None:
    n = 12
    engine = server.engine
    engine.peak_rows = 0
    delay.seconds = 0.005  # every request is still decoding when the others arrive

    def one(prompt: str) -> Any:
        return client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )

    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outs = list(pool.map(one, PROMPTS))
    finally:
        delay.seconds = 0.0
    assert engine.peak_rows >= 2  # they decoded together, at different positions
    for prompt, out in zip(PROMPTS, outs):
        want = gen.generate(prompt, temperature=0, max_new_tokens=n, ignore_eos=True)[0]
        assert out.choices[0].text == want.text, prompt
        assert out.choices[0].logprobs.tokens == pieces(char_tok, want.ids), prompt
        assert out.usage.prompt_tokens == len(char_tok.encode(prompt))
        assert out.usage.completion_tokens == n
    assert wait_idle(server.url)[0]["kv_cache_bytes"] == 0


def test_served_run_equals_the_generate_command(run_dir, capsys) -> None:
    n = 12
    served = load_served(run_dir)
    assert served.name == run_dir.name
    with serving(served.model, served.tokenizer, name=served.name) as srv:
        client = client_for(srv.url)
        assert [m.id for m in client.models.list().data] == [run_dir.name]
        for prompt in ["the", "a quick brown"]:
            argv = ["generate", str(run_dir), "--prompt", prompt, "--temperature", "0"]
            argv += ["--max-new-tokens", str(n), "--ignore-eos", "--json"]
            assert cli.main(argv) == 0
            want = json.loads(capsys.readouterr().out)
            out = client.completions.create(
                model=run_dir.name,
                prompt=prompt,
                max_tokens=n,
                temperature=0,
                logprobs=0,
                extra_body={"ignore_eos": True},
            )
            assert out.choices[0].text == want["text"]
            assert out.choices[0].logprobs.tokens == pieces(served.tokenizer, want["ids"])
            assert out.usage.completion_tokens == len(want["ids"]) == n


def test_streaming_equals_the_whole_answer(client) -> None:
    kw: dict[str, Any] = dict(model="tiny", max_tokens=10, temperature=0)
    kw["extra_body"] = {"ignore_eos": True}
    for prompt in PROMPTS[:2]:
        whole = client.completions.create(prompt=prompt, **kw)
        chunks = list(
            client.completions.create(
                prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
            )
        )
        *texts, last = chunks
        assert all(len(c.choices) == 1 and c.choices[0].index == 0 for c in texts)
        assert "".join(c.choices[0].text for c in texts) == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in texts][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in texts[:-1])
        assert len({c.id for c in chunks}) == 1
        # the usage chunk comes last, with no choices
        assert last.choices == [] and last.usage is not None
        assert last.usage.model_dump() == whole.usage.model_dump()
        assert all(c.usage is None for c in texts)
    plain = list(client.completions.create(prompt="the", stream=True, **kw))
    assert all(c.usage is None for c in plain)


def test_seeded_sampling_is_reproducible_and_equals_generate(client, gen) -> None:
    settings = dict(temperature=0.9, top_k=5)
    kw: dict[str, Any] = dict(model="tiny", prompt="the quick", max_tokens=12, seed=7)
    first = client.completions.create(extra_body={"top_k": 5}, temperature=0.9, **kw)
    again = client.completions.create(extra_body={"top_k": 5}, temperature=0.9, **kw)
    assert first.choices[0].text == again.choices[0].text
    want = gen.generate("the quick", max_new_tokens=12, seed=7, **settings)[0]
    assert first.choices[0].text == want.text
    # choice i of a seeded request draws seed + i: choice 1 is what seed 8 draws
    three = client.completions.create(extra_body={"top_k": 5}, temperature=0.9, n=3, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].text == want.text
    eight = gen.generate("the quick", max_new_tokens=12, seed=8, **settings)[0]
    assert three.choices[1].text == eight.text


def test_n_choices_and_several_prompts(client, gen) -> None:
    prompts = ["the", "a lazy brown"]
    out = client.completions.create(
        model="tiny",
        prompt=prompts,
        n=3,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == list(range(6))
    for k, prompt in enumerate(prompts):
        want = gen.generate(prompt, temperature=0, max_new_tokens=6, ignore_eos=True)[0].text
        assert [out.choices[k * 3 + i].text for i in range(3)] == [want] * 3
    assert out.usage.prompt_tokens == len("the") + len("a lazy brown")
    assert out.usage.completion_tokens == 6 * 6
    # sampled choices of one request differ (seed + i each)
    sampled = client.completions.create(model="tiny", prompt="the", n=3, max_tokens=12, seed=1)
    assert len({c.text for c in sampled.choices}) > 1
    # token-id prompts, several of them
    ids = client.completions.create(model="tiny", prompt=[[1, 2, 3], [4]], max_tokens=2)
    assert [c.index for c in ids.choices] == [0, 1]
    assert ids.usage.prompt_tokens == 4


def test_stop_strings(client, gen) -> None:
    full = gen.generate("the quick", temperature=0, max_new_tokens=16, ignore_eos=True)[0].text
    stop = full[4:6]  # two characters: the first is held back until the second decides
    cut = full[: full.find(stop)]
    kw: dict[str, Any] = dict(model="tiny", prompt="the quick", max_tokens=16, temperature=0)
    kw["extra_body"] = {"ignore_eos": True}
    out = client.completions.create(stop=[stop, "§never"], **kw)
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens <= len(cut) + len(stop)
    chunks = list(client.completions.create(stop=stop, stream=True, **kw))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert all(stop not in t for t in texts)
    assert "".join(texts) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop string that never comes: the whole answer
    none = client.completions.create(stop="§", **kw)
    assert none.choices[0].text == full and none.choices[0].finish_reason == "length"


def test_completion_logprobs(client, lm, char_tok) -> None:
    prompt = "the quick"
    out = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == list(range(8))  # one character a token
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and all(v <= 0 for v in top.values())
        assert token in top and top[token] == pytest.approx(logprob)  # greedy: the best
        assert logprob == pytest.approx(max(top.values()))
    # the values are the model's: one forward pass over the prompt and the answer
    ids = char_tok.encode(prompt) + [char_tok.encode(t)[0] for t in lp.tokens]
    expected = model_logprobs(lm, ids)[-8:]
    assert lp.token_logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def test_echo_with_logprobs_and_no_new_tokens(client, lm, char_tok) -> None:
    prompt = "the lazy dog"
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1
    )
    (choice,) = out.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == list(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    expected = model_logprobs(lm, char_tok.encode(prompt))
    assert lp.token_logprobs[1:] == pytest.approx(expected.tolist(), abs=1e-4)
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 0
    # echo with new tokens: the prompt's entries, then the answer's
    more = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=0, temperature=0
    )
    assert more.choices[0].text.startswith(prompt)
    assert len(more.choices[0].logprobs.tokens) == len(prompt) + 3


def test_models_list(client, server) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].object == "model" and models[0].owned_by == "llmkit"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_chat_needs_a_chat_template(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert info.value.status_code == 400
    assert "chat template" in info.value.body["message"]
    # the server goes on serving
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1).choices


# -- chat completions ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat(chat_run):
    run = load_run(chat_run)
    with serving(run.model, run.tokenizer, name="chat", max_batch=4) as srv:
        yield client_for(srv.url), run


def test_chat_replies_and_stops_at_the_end_of_turn(chat) -> None:
    client, run = chat
    out = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=10
    )
    assert out.object == "chat.completion" and out.model == "chat"
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content == "ok"
    assert choice.finish_reason == "stop" and choice.logprobs is None
    prompt = run.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert out.usage.prompt_tokens == len(prompt)
    # the same reply as llmkit generate --chat
    want = Generator(run.model, run.tokenizer).chat(
        [{"role": "user", "content": "hi"}], temperature=0, max_new_tokens=10
    )
    assert want.text == "ok"
    assert out.usage.completion_tokens == len(want.ids)
    # max_tokens ends a reply early
    short = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "bye"}], temperature=0, max_tokens=2
    )
    assert short.choices[0].message.content == "ci"
    assert short.choices[0].finish_reason == "length"


def test_streaming_chat(chat) -> None:
    client, _ = chat
    chunks = list(
        client.chat.completions.create(
            model="chat",
            messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "bye"}],
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first, *rest, last = chunks
    assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
    assert all(c.choices[0].delta.role is None for c in rest)
    assert "".join(c.choices[0].delta.content or "" for c in rest) == "ciao"
    assert rest[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in rest[:-1])
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens >= 4


def test_chat_logprobs(chat) -> None:
    client, _ = chat
    out = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        max_tokens=10,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    # one entry a new token (the end of the turn included: it counts in usage too)
    assert len(content) == out.usage.completion_tokens
    assert "".join(e.token for e in content).startswith("ok")
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[1].logprob <= entry.top_logprobs[0].logprob
    # logprobs without top_logprobs: the chosen tokens only
    bare = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        max_tokens=10,
        logprobs=True,
    )
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)
    assert all(math.isfinite(e.logprob) for e in bare.choices[0].logprobs.content)


def test_chat_several_choices(chat) -> None:
    client, _ = chat
    out = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], temperature=0, n=2
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.message.content for c in out.choices] == ["ok", "ok"]
    chunks = list(
        client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "hi"}],
            temperature=0,
            n=2,
            stream=True,
        )
    )
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == "ok"
        assert mine[-1].finish_reason == "stop"
