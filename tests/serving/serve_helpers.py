"""Helpers of the serving tests: tiny random models, a forward hook that slows a model
down, a server on a model (:class:`~llmkit.serving.server.ServerThread` at a free port) and
its /health, and the OpenAI error schema."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import torch

from llmkit.model import build_model
from llmkit.serving import Engine
from llmkit.serving.server import ServerThread
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

CORPUS = "the quick brown fox jumps over the lazy dog.\n" * 3


def random_lm(tok: Any, max_seq_len: int = 64) -> Any:
    """A random tiny model over ``tok``'s vocabulary (rope: batches may be padded)."""
    torch.manual_seed(0)
    spec = tiny_spec(
        vocab_size=tok.vocab_size,
        position={"name": "rope"},
        max_seq_len=max_seq_len,
        init_std=0.2,
    )
    return build_model(load_spec_dict(spec)).eval()


class Delay:
    """A forward hook that sleeps ``seconds`` after every forward pass of ``model`` (a
    prefill chunk or a decoding step of the engine), so that a request stays in flight long
    enough to be interrupted; ``calls`` counts the passes."""

    def __init__(self, model: Any, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.calls = 0
        self.handle = model.register_forward_hook(self)

    def __call__(self, *_: Any) -> None:
        self.calls += 1
        if self.seconds:
            time.sleep(self.seconds)

    def remove(self) -> None:
        self.handle.remove()


@contextmanager
def serving(model: Any, tok: Any, *, name: str = "tiny", **kwargs: Any) -> Iterator[ServerThread]:
    """A server on ``model``; ``max_batch`` and ``prefill_tokens`` go to the engine, the
    other keywords (``max_concurrent``, ``max_body``) to the application."""
    engine_kw = {k: kwargs.pop(k) for k in ("max_batch", "prefill_tokens") if k in kwargs}
    engine = Engine(model, tok, **engine_kw)
    with ServerThread(engine, model_name=name, **kwargs) as server:
        yield server


def health(url: str) -> dict[str, Any]:
    response = httpx.get(url + "/health", timeout=5)
    assert response.status_code == 200
    return response.json()


def wait_idle(url: str, timeout: float = 10.0) -> tuple[dict[str, Any], float]:
    """Poll /health until nothing waits, runs or is in flight (at most ``timeout`` seconds);
    the last health and the seconds waited."""
    start = time.monotonic()
    while True:
        state = health(url)
        idle = state["running"] == 0 and state["waiting"] == 0 and state["in_flight"] == 0
        waited = time.monotonic() - start
        if idle or waited > timeout:
            return state, waited
        time.sleep(0.02)


def assert_api_error(
    response: httpx.Response,
    status: int,
    *,
    code: str | None = None,
    param: str | None = None,
    kind: str | None = None,
) -> dict[str, Any]:
    """``response`` is a ``status`` with the OpenAI error schema (JSON ``{"error":
    {"message", "type", "param", "code"}}``); the error object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert list(body) == ["error"], body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    if kind is not None:
        assert err["type"] == kind, err
    return err
