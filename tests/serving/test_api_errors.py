"""Bad requests to ``llmkit serve`` get a 4xx with the OpenAI error schema (``{"error":
{"message", "type", "param", "code"}}``), and the server goes on serving: every test sends
a good request after its bad ones. ``--max-concurrent`` answers 429 while it is reached."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.serving.serve_helpers import Delay, assert_api_error, health, serving, wait_idle

GOOD = {"model": "tiny", "prompt": "the", "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(lm, char_tok):
    """The random tiny model (a context of 64 tokens) as "tiny", a batch of 4 choices."""
    with serving(lm, char_tok, name="tiny", max_batch=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=10) as client:
        yield client


def completion(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/completions", json={**GOOD, **fields})


def raw(http: httpx.Client, body: bytes, path: str = "/v1/completions") -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


def assert_serving(http: httpx.Client) -> None:
    """A good request still gets its answer, and nothing is left in flight."""
    response = http.post("/v1/completions", json=GOOD)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    state = health(str(http.base_url).rstrip("/"))
    assert state["in_flight"] == 0


def test_unknown_model(http) -> None:
    err = assert_api_error(completion(http, model="gpt-9"), 404, code="model_not_found")
    assert err["param"] == "model" and "gpt-9" in err["message"]
    chat = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    assert_api_error(http.post("/v1/chat/completions", json=chat), 404, code="model_not_found")
    assert_api_error(http.get("/v1/models/gpt-9"), 404, code="model_not_found")
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    assert_serving(http)


def test_context_length(http) -> None:
    # the prompt alone fills the context (64 tokens)
    err = assert_api_error(
        completion(http, prompt="x" * 64), 400, code="context_length_exceeded", param="prompt"
    )
    assert "64" in err["message"]
    assert_api_error(completion(http, prompt="x" * 500, max_tokens=None), 400, param="prompt")
    assert_api_error(completion(http, prompt=[[1] * 70]), 400, code="context_length_exceeded")
    # the prompt and max_tokens together do not fit; one token less does
    assert_api_error(
        completion(http, prompt="x" * 60, max_tokens=5),
        400,
        code="context_length_exceeded",
        param="max_tokens",
    )
    fits = completion(http, prompt="x" * 60, max_tokens=4, ignore_eos=True)
    assert fits.status_code == 200
    # no max_tokens: the rest of the context
    rest = completion(http, prompt="x" * 60, max_tokens=None, ignore_eos=True)
    assert rest.json()["usage"]["completion_tokens"] == 4
    assert_serving(http)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"n": "three"}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"model": 5}, "model"),
        ({"stream_options": "usage"}, "stream_options"),
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"stream": "yes"}, "stream"),  # strict: no bool from text, no token id from true
        ({"prompt": [1, True]}, "prompt"),
        ({"n": 2.0}, "n"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": "x" * 300}, "stop"),
    ],
)
def test_invalid_fields(http, fields, param) -> None:
    assert_api_error(completion(http, **fields), 400, param=param, kind="invalid_request_error")
    assert_serving(http)


@pytest.mark.parametrize(
    "fields",
    [
        {"logit_bias": {"31": 1}},  # the vocabulary is 0..30
        {"logit_bias": {"-1": 1}},
        {"logit_bias": {"99999999999999999999999": 1}},
        {"logit_bias": {"3": 500}},
        {"prompt": [5, 31]},
        {"prompt": [-1]},
        {"n": 5},  # more than the batch of 4
        {"stop": [""]},
        {"seed": 10**30},
    ],
)
def test_values_the_engine_refuses(http, fields) -> None:
    assert_api_error(completion(http, **fields), 400, kind="invalid_request_error")
    assert_serving(http)


def test_bodies_that_are_not_a_json_object(http) -> None:
    for body in [b"{bad", b"", b"\xff\xfe{}", b'{"model": "tiny",}']:
        err = assert_api_error(raw(http, body), 400)
        assert "not valid JSON" in err["message"]
    for body in [b"[1, 2]", b"null", b'"the"', b"5"]:
        err = assert_api_error(raw(http, body), 400)
        assert "JSON object" in err["message"]
    # JSON's non-standard numbers are refused by the checks, not turned into NaN answers
    for body in [
        b'{"model": "tiny", "prompt": "the", "temperature": NaN}',
        b'{"model": "tiny", "prompt": "the", "temperature": Infinity}',
        b'{"model": "tiny", "prompt": "the", "repetition_penalty": Infinity}',
        b'{"model": "tiny", "prompt": "the", "logit_bias": {"1": NaN}}',
    ]:
        assert_api_error(raw(http, body), 400)
    # a lone surrogate (valid JSON, not text) in a prompt, a message, a stop string
    assert_api_error(raw(http, b'{"model": "tiny", "prompt": "\\ud800"}'), 400, param="prompt")
    assert_api_error(raw(http, b'{"model": "tiny", "prompt": ["a", "\\udfff"]}'), 400)
    assert_api_error(raw(http, b'{"model": "tiny", "prompt": "a", "stop": "\\ud800"}'), 400)
    assert_serving(http)


def test_chat_bodies(http) -> None:
    def chat(**fields: Any) -> httpx.Response:
        return http.post("/v1/chat/completions", json={"model": "tiny", **fields})

    assert_api_error(chat(messages=[]), 400, param="messages")
    assert_api_error(chat(), 400, param="messages")
    assert_api_error(chat(messages=[{"role": "wizard", "content": "hi"}]), 400)
    assert_api_error(chat(messages="hi"), 400, param="messages")
    msgs = [{"role": "user", "content": "hi"}]
    assert_api_error(chat(messages=msgs, max_tokens=0), 400, param="max_tokens")
    assert_api_error(chat(messages=msgs, top_logprobs=30), 400, param="top_logprobs")
    assert_api_error(chat(messages=msgs, top_logprobs=2), 400, param="top_logprobs")
    assert_api_error(
        chat(messages=[{"role": "user", "content": 5}]), 400, param="messages.0.content"
    )
    # well formed, but this model has no chat template
    err = assert_api_error(chat(messages=msgs), 400)
    assert "chat template" in err["message"]
    assert_serving(http)


def test_a_body_over_the_limit(http) -> None:
    big = b'{"model": "tiny", "prompt": "' + b"x" * (10 * 1024 * 1024) + b'"}'
    assert_api_error(raw(http, big), 413, code="request_too_large")

    def chunks():  # no Content-Length: the size is found while reading
        for _ in range(10):
            yield b"x" * (1024 * 1024)

    response = http.post("/v1/completions", content=chunks())
    assert_api_error(response, 413, code="request_too_large")
    assert_serving(http)


def test_unknown_routes_and_methods(http) -> None:
    err = assert_api_error(http.get("/v2/everything"), 404)
    assert "/v2/everything" in err["message"]
    assert_api_error(http.post("/v1/embeddings", json={}), 404)
    assert_api_error(http.get("/v1/completions"), 405)
    assert_api_error(http.delete("/v1/models"), 405)
    assert_serving(http)


def test_the_openai_client_raises_its_errors(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other", prompt="x", max_tokens=1)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x" * 80, max_tokens=1)
    assert bad.value.code == "context_length_exceeded" and bad.value.param == "prompt"


def test_max_concurrent(lm, char_tok) -> None:
    """With max_concurrent = 1 a second request while a stream is in flight gets a 429;
    once the stream ended requests are served again."""
    delay = Delay(lm, 0.02)
    try:
        with (
            serving(lm, char_tok, name="tiny", max_concurrent=1) as srv,
            httpx.Client(base_url=srv.url, timeout=10) as http,
        ):
            long = {**GOOD, "max_tokens": 40, "stream": True, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=long) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()
                assert next(lines).startswith("data: {")  # the request is decoding
                assert health(srv.url)["in_flight"] == 1
                err = assert_api_error(
                    completion(http), 429, code="rate_limit_exceeded", kind="rate_limit_error"
                )
                assert "1 request" in err["message"]
                chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
                assert_api_error(http.post("/v1/chat/completions", json=chat), 429)
                client = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    client.completions.create(model="tiny", prompt="x", max_tokens=1)
                # /health and /v1/models are not requests in flight
                assert http.get("/v1/models").status_code == 200
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            assert len(rest) == 40  # 39 more tokens, then [DONE]
            assert wait_idle(srv.url)[0]["in_flight"] == 0
            delay.seconds = 0.0
            assert_serving(http)
            assert_serving(http)  # the slot came back after each
    finally:
        delay.remove()


def test_the_serve_command_enforces_max_concurrent(run_dir, monkeypatch) -> None:
    """``llmkit serve RUN --max-concurrent 1``: the flags reach the engine and the app (the
    server runs in a thread here: serve_forever without its signal handling)."""
    import uvicorn

    from llmkit import cli
    from llmkit.serving import server as server_module

    started: dict[str, Any] = {}

    def serve_in_thread(engine, sock, *, model_name, max_concurrent=64) -> None:
        config = server_module._config(engine, model_name, max_concurrent, log_level="warning")
        started["server"] = uvicorn.Server(config)
        started["engine"] = engine
        started["url"] = f"http://127.0.0.1:{sock.getsockname()[1]}"
        started["server"].run(sockets=[sock])

    monkeypatch.setattr(server_module, "serve_forever", serve_in_thread)
    argv = ["serve", str(run_dir), "--port", "0", "--max-concurrent", "1", "--max-batch", "2"]
    argv += ["--prefill-tokens", "4", "--model-name", "served"]
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(cli.main(argv)))
    thread.start()
    deadline = time.monotonic() + 30
    while not (started.get("server") and started["server"].started):
        assert thread.is_alive() and time.monotonic() < deadline, codes
        time.sleep(0.01)
    url, engine = started["url"], started["engine"]
    delay = Delay(engine.model, 0.02)
    try:
        assert (engine.max_batch, engine.prefill_tokens) == (2, 4)
        with httpx.Client(base_url=url, timeout=10) as http:
            card = http.get("/v1/models").json()["data"][0]
            assert card["id"] == "served" and card["max_model_len"] == 64
            long = {**GOOD, "model": "served", "max_tokens": 30, "stream": True}
            with http.stream("POST", "/v1/completions", json={**long, "ignore_eos": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                assert_api_error(completion(http, model="served"), 429, code="rate_limit_exceeded")
                assert [line for line in lines if line][-1] == "data: [DONE]"
            assert wait_idle(url)[0]["in_flight"] == 0
            assert completion(http, model="served").status_code == 200
    finally:
        delay.remove()
        started["server"].should_exit = True
        thread.join(30)
    assert codes == [0]


def test_the_serve_command_refuses_a_bad_port(run_dir, capsys) -> None:
    from llmkit import cli

    assert cli.main(["serve", str(run_dir), "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert "--port" in err and len(err.strip().splitlines()) == 1


# -- one request's failure: answered, and the others go on ----------------------------------
# A temperature so small that logits / temperature overflow leaves no finite probabilities
# (``llmkit generate`` refuses it with "no finite sampling probabilities"): the request that
# asked for it gets a 400 naming the temperature; a request decoding beside it is untouched.


def test_a_temperature_that_overflows_is_answered(http) -> None:
    body = {**GOOD, "temperature": 1e-45, "max_tokens": 3}
    response = http.post("/v1/completions", json=body, timeout=3)
    assert_api_error(response, 400)
    assert "temperature" in response.json()["error"]["message"]
    assert_serving(http)


def test_one_request_failing_does_not_fail_the_others(lm, char_tok) -> None:
    delay = Delay(lm, 0.01)
    try:
        with (
            serving(lm, char_tok, name="tiny") as srv,
            httpx.Client(base_url=srv.url, timeout=5) as http,
        ):
            lines: list[str] = []

            def stream() -> None:
                long = {**GOOD, "max_tokens": 30, "stream": True, "ignore_eos": True}
                with http.stream("POST", "/v1/completions", json=long) as response:
                    lines.extend(line for line in response.iter_lines() if line)

            thread = threading.Thread(target=stream)
            thread.start()
            try:
                deadline = time.monotonic() + 10
                while health(srv.url)["running"] == 0:  # the stream is decoding
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                bad = {**GOOD, "temperature": 1e-45, "max_tokens": 3}
                assert http.post("/v1/completions", json=bad, timeout=3).status_code == 400
            finally:
                thread.join(15)
            assert not any('"error"' in line for line in lines), lines[-2:]
            assert len(lines) == 31 and lines[-1] == "data: [DONE]"
    finally:
        delay.remove()


# A field whose type is a union is named as the field (the OpenAI API's "param"), not as
# pydantic's union member ("stop.str").


@pytest.mark.parametrize(("fields", "param"), [({"stop": 5}, "stop"), ({"prompt": None}, "prompt")])
def test_union_fields_are_named_as_the_field(http, fields, param) -> None:
    assert_api_error(completion(http, **fields), 400, param=param)
    assert_serving(http)
