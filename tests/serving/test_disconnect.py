"""A client that goes away cancels its request: a stream closed after a few chunks, a
non-streaming request whose client timed out, a request still queued. Its rows of the KV
cache are freed long before ``max_tokens`` could have been generated, and its slot of
``--max-concurrent`` comes back."""

from __future__ import annotations

import time
from itertools import islice
from typing import Any

import httpx
import openai
import pytest

from tests.serving.serve_helpers import Delay, health, random_lm, serving, wait_idle

#: New tokens asked for: the context (512) less the prompt; at 10 ms a step, over 5 s.
MAX_TOKENS = 500
#: Engine steps a cancelled request may still have taken (far fewer than MAX_TOKENS).
SOME_STEPS = 150


@pytest.fixture(scope="module")
def slow(char_tok):
    """A random tiny model with a context of 512 whose every forward pass takes 10 ms more."""
    model = random_lm(char_tok, max_seq_len=512)
    return model, Delay(model, 0.01)


@pytest.fixture(scope="module")
def server(slow, char_tok):
    model, _ = slow
    with serving(model, char_tok, name="tiny", max_batch=4) as srv:
        yield srv


def long_request(**fields: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": "the",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }


def assert_freed(url: str, steps_before: int, delay: Delay) -> None:
    """Nothing runs, waits or is in flight, the cache is gone, and few steps ran."""
    state, waited = wait_idle(url)
    assert state["running"] == 0 and state["waiting"] == 0, state
    assert state["in_flight"] == 0 and state["kv_cache_bytes"] == 0, state
    assert waited < 3.0
    assert delay.calls - steps_before < SOME_STEPS
    # and the server goes on serving
    response = httpx.post(url + "/v1/completions", json=long_request(max_tokens=2), timeout=10)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_a_closed_stream_is_cancelled(server, slow) -> None:
    _, delay = slow
    before = delay.calls
    url = server.url + "/v1/completions"
    with httpx.stream("POST", url, json=long_request(stream=True), timeout=10) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a generator dropped early closes the connection
        chunks = [line for line in islice(lines, 6) if line]  # data, blank, ...
        assert len(chunks) == 3 and all(c.startswith("data: {") for c in chunks)
        state = health(server.url)
        assert state["running"] == 1 and state["in_flight"] == 1
        assert state["kv_cache_bytes"] > 0
    assert_freed(server.url, before, delay)


def test_a_closed_stream_of_several_choices_frees_every_row(server, slow) -> None:
    _, delay = slow
    before = delay.calls
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="tiny",
        prompt="the",
        max_tokens=MAX_TOKENS,
        n=3,
        temperature=0.8,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = set()
    for chunk in stream:
        seen.add(chunk.choices[0].index)
        if len(seen) == 3:
            break
    assert health(server.url)["running"] == 3
    stream.close()
    assert_freed(server.url, before, delay)


def test_a_client_that_timed_out_is_cancelled(server, slow) -> None:
    _, delay = slow
    before = delay.calls
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=long_request(), timeout=0.4)
    assert_freed(server.url, before, delay)


def test_a_queued_request_whose_client_left_is_dropped(server, slow) -> None:
    """While four choices fill the batch a second request waits; its client leaves: it is
    gone from the queue and the running request goes on."""
    _, delay = slow
    before = delay.calls
    with httpx.Client(timeout=10) as http:
        first = long_request(stream=True, n=4, temperature=0.8)
        with http.stream("POST", server.url + "/v1/completions", json=first) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            with pytest.raises(httpx.TimeoutException):
                http.post(server.url + "/v1/completions", json=long_request(), timeout=0.3)
            deadline = time.monotonic() + 5
            while (state := health(server.url))["waiting"] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert state["waiting"] == 0 and state["running"] == 4, state
            assert next(lines) is not None  # the first request still streams
    assert_freed(server.url, before, delay)
