"""The ASGI application (Starlette): ``POST /v1/completions``, ``POST /v1/chat/completions``
(the tokenizer's chat template), ``GET /v1/models``, ``GET /health``; streaming as
server-sent events; the OpenAI API's error schema for every failure.

Requests go to the :class:`~llmkit.serving.engine.Engine` (its thread); its events come back
to the event loop through an :class:`asyncio.Queue` per HTTP request. More than
``max_concurrent`` requests in flight get a 429; a body over ``max_body`` bytes a 413; a
client that disconnects has its request cancelled, which frees its rows of the KV cache."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmkit.inference.checks import GenerationError
from llmkit.serving.engine import Engine
from llmkit.serving.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
    parse,
    usage,
)
from llmkit.serving.sequences import Event, Request, SamplingParams, Token

log = logging.getLogger("llmkit.serving")

#: The largest request body read (bytes); a larger one gets a 413.
MAX_BODY = 4 * 1024 * 1024
#: A body over the limit is still read (and thrown away) up to this size, so the client
#: gets its 413 instead of a connection reset while it sends.
_DRAIN = 64 * 1024 * 1024


@dataclass
class ServerState:
    """What every handler needs: the engine, the name the model is served under, and the
    limits."""

    engine: Engine
    model_name: str
    max_concurrent: int = 64
    max_body: int = MAX_BODY
    created: int = field(default_factory=now)
    in_flight: int = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def limit(self) -> int:
        return self.engine.limit


class _Flight:
    """The engine requests of one HTTP request and the queue their events arrive on."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event] | None] = asyncio.Queue()
        self.requests: list[Request] = []
        self.total = 0

    def submit(self, prompts: list[list[int]], params: SamplingParams, n: int) -> None:
        for k, ids in enumerate(prompts):

            def emit(event: Event, k: int = k) -> None:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (k, event))

            request = Request(ids, params, emit, n)
            self.engine.check(request)
            self.requests.append(request)
        for request in self.requests:
            self.engine.submit(request)
        self.total = len(prompts) * n

    def cancel(self) -> None:
        for request in self.requests:
            request.cancel()
        self.engine.wake()

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(prompt number, event) until every choice has finished; an engine error is a
        500; a disconnect (None) ends the iteration."""
        finished = 0
        while finished < self.total:
            item = await self.queue.get()
            if item is None:
                return
            k, event = item
            if event.error is not None:
                if event.error_by_request:
                    raise ApiError(400, event.error)
                raise ApiError(500, event.error, kind="server_error")
            if event.finish_reason is not None:
                finished += 1
            yield k, event


def create_app(
    engine: Engine,
    *,
    model_name: str,
    max_concurrent: int = 64,
    max_body: int = MAX_BODY,
    manage_engine: bool = True,
) -> Starlette:
    """The application serving ``engine`` as ``model_name``. With ``manage_engine`` the
    application's lifespan starts the engine and stops it after the server drained."""
    state = ServerState(engine, model_name, max_concurrent, max_body)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(engine.stop)

    async def health(request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", "in_flight": state.in_flight, **engine.stats()})

    async def models(request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    async def model(request: HttpRequest) -> Response:
        _check_model(state, request.path_params["name"])
        return JSONResponse(_model_card(state))

    async def completions(request: HttpRequest) -> Response:
        return await _serve(state, request, _completion)

    async def chat(request: HttpRequest) -> Response:
        return await _serve(state, request, _chat)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ]
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _server_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)  # type: ignore[arg-type]
    app.state.llmkit = state
    return app


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "llmkit",
        "max_model_len": state.limit,
    }


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise ApiError(
            404,
            f"the model {name!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


async def _api_error(request: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(err.body(), status_code=exc.status_code)


async def _server_error(request: HttpRequest, exc: Exception) -> Response:
    log.exception("serving: a request failed", exc_info=exc)
    err = ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error")
    return JSONResponse(err.body(), status_code=500)


async def _read_json(request: HttpRequest, limit: int) -> Any:
    """The body as JSON; a 413 over ``limit`` bytes, a 400 when it is not JSON."""
    declared = request.headers.get("content-length")
    body = bytearray()
    too_large = declared is not None and declared.isdigit() and int(declared) > limit
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            too_large = True
            if len(body) > _DRAIN:
                break
            body.clear()
    if too_large:
        raise ApiError(
            413, f"the request body is larger than {limit:,} bytes", code="request_too_large"
        )
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None


async def _serve(state: ServerState, request: HttpRequest, handler: Any) -> Response:
    """Admit a request (429 when ``max_concurrent`` are in flight), read and check it, and
    let ``handler`` answer it; the slot is held until the answer (or its stream) ends."""
    if state.in_flight >= state.max_concurrent:
        raise ApiError(
            429,
            f"this server is at its limit of {state.max_concurrent} requests in flight; "
            "retry later",
            kind="rate_limit_error",
            code="rate_limit_exceeded",
        )
    state.in_flight += 1
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            state.in_flight -= 1

    try:
        data = await _read_json(request, state.max_body)
        response = await handler(state, request, data, release)
    except BaseException:
        release()
        raise
    if not isinstance(response, StreamingResponse):
        release()
    return response


def _encode(state: ServerState, text: str) -> list[int]:
    from llmkit.data.long_text import encode_long
    from llmkit.inference.checks import text_problem

    problem = text_problem(text)
    if problem is not None:
        raise ApiError(400, f"prompt: {problem}", param="prompt")
    if state.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: send the prompt as token ids")
    ids = encode_long(state.tokenizer, text).tolist() if text else []
    return ids or [_eos(state) or 0]


def _eos(state: ServerState) -> int | None:
    eos = getattr(state.tokenizer, "eos_id", None)
    return eos if isinstance(eos, int) else None


def _max_tokens(state: ServerState, prompts: list[list[int]], asked: int | None) -> int:
    """The completion length: ``asked``, or the rest of the context; a 400 when a prompt
    and it do not fit in the context."""
    longest = max(len(p) for p in prompts)
    if longest >= state.limit:
        raise ApiError(
            400,
            f"this model's maximum context length is {state.limit} tokens; the prompt has "
            f"{longest}",
            param="prompt",
            code="context_length_exceeded",
        )
    if asked is None:
        return state.limit - longest
    if longest + asked > state.limit:
        raise ApiError(
            400,
            f"this model's maximum context length is {state.limit} tokens; you asked for "
            f"{longest + asked} ({longest} in the prompt, {asked} for the completion)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return asked


def _params(
    state: ServerState, body: Any, max_tokens: int, stop_ids: set[int], **extra: Any
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=body.top_k_or_none(),
        top_p=body.top_p,
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stops(),
        stop_ids=frozenset(stop_ids),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.bias(),
        **extra,
    )


def _submit(
    state: ServerState, prompts: list[list[int]], params: SamplingParams, n: int
) -> _Flight:
    flight = _Flight(state.engine)
    try:
        flight.submit(prompts, params, n)
    except GenerationError as exc:
        raise ApiError(400, str(exc)) from None
    return flight


async def _watch(request: HttpRequest, flight: _Flight) -> None:
    """Cancel ``flight`` when the client disconnects (a non-streaming request)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            flight.cancel()
            flight.queue.put_nowait(None)
            return


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _stream(flight: _Flight, chunks: AsyncIterator[str], release: Any) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except ApiError as exc:
            yield _sse(exc.body())
        finally:
            flight.cancel()  # a no-op for requests that finished; frees a client's gone
            release()
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _collect(
    request: HttpRequest, flight: _Flight, total: int
) -> tuple[list[list[Token]], list[str], list[str | None], dict[int, list[Token]]]:
    """Every choice's tokens, text and finish reason, and each prompt's tokens (echo)."""
    tokens: list[list[Token]] = [[] for _ in range(total)]
    texts = [""] * total
    reasons: list[str | None] = [None] * total
    prompt: dict[int, list[Token]] = {}
    n = total // max(len(flight.requests), 1)
    watcher = asyncio.create_task(_watch(request, flight))
    try:
        async for k, event in flight.events():
            if event.prompt is not None:
                prompt[k] = event.prompt
                continue
            i = k * n + event.index
            tokens[i] += event.tokens
            texts[i] += event.text
            reasons[i] = event.finish_reason or reasons[i]
    finally:
        watcher.cancel()
        flight.cancel()
    return tokens, texts, reasons, prompt


# -- /v1/completions ----------------------------------------------------------------------


def _completion_prompts(
    state: ServerState, body: CompletionRequest
) -> tuple[list[list[int]], list[str | None]]:
    """Token ids of each prompt, and its text (None for ids) for echo."""
    p = body.prompt
    if isinstance(p, str):
        return [_encode(state, p)], [p]
    if not p:
        raise ApiError(400, "prompt: empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)], [None]  # type: ignore[arg-type]
    if all(isinstance(x, str) for x in p):
        return [_encode(state, x) for x in p], list(p)  # type: ignore[arg-type]
    if any(not x for x in p):
        raise ApiError(400, "prompt: a list of token ids is empty", param="prompt")
    return [list(x) for x in p], [None] * len(p)  # type: ignore[arg-type,misc]


async def _completion(
    state: ServerState, request: HttpRequest, data: Any, release: Any
) -> Response:
    body: CompletionRequest = parse(CompletionRequest, data)
    _check_model(state, body.model)
    if body.suffix:
        raise ApiError(400, "suffix (insertion) is not supported", param="suffix")
    if body.best_of not in (None, body.n):
        raise ApiError(400, "best_of is not supported (use n)", param="best_of")
    # tokenizing (up to the body's 4 MiB of text) runs off the event loop: other streams go on
    prompts, texts = await asyncio.to_thread(_completion_prompts, state, body)
    max_tokens = _max_tokens(state, prompts, body.max_tokens)
    eos = _eos(state)
    params = _params(
        state,
        body,
        max_tokens,
        {eos} if eos is not None else set(),
        logprobs=body.logprobs,
        prompt_logprobs=body.echo and body.logprobs is not None,
    )
    flight = _submit(state, prompts, params, body.n)
    text_of = TokenText(state.tokenizer)
    rid, created, n = new_id("cmpl"), now(), body.n

    def echo(k: int) -> str:
        if not body.echo:
            return ""
        t = texts[k]
        return (
            t
            if t is not None
            else text_of.tokenizer.decode(prompts[k])
            if text_of.tokenizer
            else ""
        )

    if body.stream:
        return _stream(
            flight,
            _completion_chunks(state, body, flight, prompts, echo, text_of, rid, created),
            release,
        )
    tokens, outs, reasons, prompt = await _collect(request, flight, len(prompts) * n)
    choices = []
    for i in range(len(prompts) * n):
        k = i // n
        logprobs = None
        if body.logprobs is not None:
            shown = (prompt.get(k, []) if body.echo else []) + tokens[i]
            logprobs, _ = completion_logprobs(shown, text_of, 0)
        choices.append(
            {
                "index": i,
                "text": echo(k) + outs[i],
                "logprobs": logprobs,
                "finish_reason": reasons[i],
            }
        )
    used = usage(sum(len(p) for p in prompts), sum(len(t) for t in tokens))
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": used,
        }
    )


async def _completion_chunks(
    state: ServerState,
    body: CompletionRequest,
    flight: _Flight,
    prompts: list[list[int]],
    echo: Any,
    text_of: TokenText,
    rid: str,
    created: int,
) -> AsyncIterator[str]:
    n = body.n
    started: set[int] = set()
    offsets: dict[int, int] = {}
    completion = 0
    prompt_tokens: dict[int, list[Token]] = {}

    def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
        return _sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": state.model_name,
                "choices": choices,
                **more,
            }
        )

    async for k, event in flight.events():
        if event.prompt is not None:
            prompt_tokens[k] = event.prompt
            continue
        i = k * n + event.index
        text = event.text
        shown = event.tokens
        if i not in started:
            started.add(i)
            text = echo(k) + text
            if body.echo:
                shown = prompt_tokens.get(k, []) + shown
        completion += len(event.tokens)
        logprobs = None
        if body.logprobs is not None:
            logprobs, offsets[i] = completion_logprobs(shown, text_of, offsets.get(i, 0))
        yield chunk(
            [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": event.finish_reason}]
        )
    if body.stream_options is not None and body.stream_options.include_usage:
        yield chunk([], usage=usage(sum(len(p) for p in prompts), completion))


# -- /v1/chat/completions -----------------------------------------------------------------


def _chat_prompt(state: ServerState, body: ChatRequest) -> list[int]:
    tok = state.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ApiError(
            400,
            f"the model {state.model_name!r} has no chat template (tokenizer_config.json); "
            "use /v1/completions",
        )
    if body.tools:
        raise ApiError(400, "tools are not supported", param="tools")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    from llmkit.inference.checks import text_problem

    for i, m in enumerate(messages):
        problem = text_problem(m["content"])
        if problem is not None:
            raise ApiError(400, f"messages.{i}.content: {problem}", param=f"messages.{i}")
    try:
        return list(tok.apply_chat_template(messages, add_generation_prompt=True))
    except Exception as exc:  # a template that raises (e.g. roles it does not allow)
        raise ApiError(400, f"the chat template cannot render these messages: {exc}") from None


async def _chat(state: ServerState, request: HttpRequest, data: Any, release: Any) -> Response:
    body: ChatRequest = parse(ChatRequest, data)
    _check_model(state, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    prompt = await asyncio.to_thread(_chat_prompt, state, body)  # rendering: off the loop
    asked = body.max_completion_tokens or body.max_tokens
    max_tokens = _max_tokens(state, [prompt], asked)
    stops = set(getattr(state.tokenizer, "stop_ids", None) or ())
    eos = _eos(state)
    if not stops and eos is not None:
        stops = {eos}
    top = body.top_logprobs if body.logprobs else None
    params = _params(state, body, max_tokens, stops, logprobs=(top or 0) if body.logprobs else None)
    flight = _submit(state, [prompt], params, body.n)
    text_of = TokenText(state.tokenizer)
    rid, created = new_id("chatcmpl"), now()
    if body.stream:
        return _stream(
            flight, _chat_chunks(state, body, flight, prompt, text_of, rid, created), release
        )
    tokens, outs, reasons, _ = await _collect(request, flight, body.n)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": outs[i]},
            "logprobs": {"content": chat_logprobs(tokens[i], text_of)} if body.logprobs else None,
            "finish_reason": reasons[i],
        }
        for i in range(body.n)
    ]
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": usage(len(prompt), sum(len(t) for t in tokens)),
        }
    )


async def _chat_chunks(
    state: ServerState,
    body: ChatRequest,
    flight: _Flight,
    prompt: list[int],
    text_of: TokenText,
    rid: str,
    created: int,
) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
        return _sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": state.model_name,
                "choices": choices,
                **more,
            }
        )

    for i in range(body.n):
        yield chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
    completion = 0
    async for _, event in flight.events():
        completion += len(event.tokens)
        delta = {"content": event.text} if event.text or event.finish_reason is None else {}
        logprobs = {"content": chat_logprobs(event.tokens, text_of)} if body.logprobs else None
        yield chunk(
            [
                {
                    "index": event.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": event.finish_reason,
                }
            ]
        )
    if body.stream_options is not None and body.stream_options.include_usage:
        yield chunk([], usage=usage(len(prompt), completion))
