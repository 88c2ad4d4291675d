"""The serving engine: continuous batching of many requests over one model.

Every iteration (:meth:`Engine.step`) takes the requests that arrived, prefills prompts (up
to ``prefill_tokens`` prompt tokens an iteration, a long prompt in chunks over several),
admits the choices whose prompt is done into the running batch, and decodes one token for
every running choice in one forward pass. A choice leaves the batch at the token it ends on
(a stop id or string, ``max_tokens``, the context's end) or when its request is cancelled
(a client that went away); its rows of the KV cache go with it.

The KV cache is one batched :class:`~llmkit.model.KVCache`: a prompt is prefilled into a
cache of its own (one row, no padding: the same computation as ``llmkit generate``), which
then joins the batch by :meth:`KVCache.concatenate` (right-aligned, the shorter contexts
left-padded and masked, each row at its own positions); finished rows leave by
:meth:`KVCache.select`, which also drops the columns left holding only padding. This is the
padded-batch form of continuous batching of Hugging Face TGI's first server, rather than
vLLM's paged blocks: it needs no attention kernel of its own, so every registered kernel
(dense, sdpa, the Triton flash kernel, sliding windows with their rolling buffers) serves.

The engine runs in a thread of its own (:meth:`start`); :meth:`submit` and
:meth:`Request.cancel` may be called from any thread, and each request's ``emit`` is called
from the engine's thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.utils import parametrize

from llmkit.inference.checks import GenerationError
from llmkit.inference.decode import model_device
from llmkit.inference.streaming import TokenizerLike
from llmkit.model import KVCache, Transformer
from llmkit.serving.sequences import (
    Event,
    Request,
    Sequence,
    Token,
    choose_tokens,
    prompt_tokens,
)

log = logging.getLogger("llmkit.serving")


@dataclass
class _Prefill:
    """A request whose prompt is being fed: its cache, how far it got, the logits that
    predict the next prompt token (prompt log-probabilities) and the prompt's tokens."""

    request: Request
    cache: KVCache | None = None
    done: int = 0
    carry: Tensor | None = None
    started: bool = False
    prompt: list[Token] = field(default_factory=list)


class Engine:
    """Continuous batching over ``model`` (a :class:`~llmkit.model.Transformer` that decodes
    through a KV cache) with ``tokenizer`` (text, stop strings).

    ``max_batch`` bounds the choices decoding at once (a request's ``n`` choices count
    ``n``); ``prefill_tokens`` bounds the prompt tokens fed per iteration, so a long prompt
    delays the running choices' next token by at most that much work."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: TokenizerLike | None,
        *,
        max_batch: int = 16,
        prefill_tokens: int = 512,
    ) -> None:
        if not model.supports_kv_cache:
            raise GenerationError(
                "serving needs a model that decodes through a KV cache: every attention must "
                "declare kv_cache = true"
            )
        if max_batch < 1 or prefill_tokens < 1:
            raise ValueError("max_batch and prefill_tokens must be ≥ 1")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = model_device(model)
        self.limit = model.config.max_seq_len
        self.vocab = model.config.vocab_size
        self.max_batch = max_batch
        self.prefill_tokens = prefill_tokens
        self._cond = threading.Condition()
        self._inbox: list[Request] = []
        self._waiting: deque[_Prefill] = deque()
        self._running: list[Sequence] = []
        self._cache: KVCache | None = None
        self._next: Tensor | None = None  # (rows,) the token each running row feeds next
        self._stopping = False
        self._thread: threading.Thread | None = None
        #: Iterations run, and the most rows one decoding step held (tests, benchmarks).
        self.iterations = 0
        self.peak_rows = 0

    # -- the outside: any thread -----------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise :class:`GenerationError` for a request the engine cannot run."""
        prompt = request.prompt
        if not prompt:
            raise GenerationError("the prompt has no tokens")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= self.vocab:
            bad = low if low < 0 else high
            raise GenerationError(
                f"token id {bad} is outside the model's vocabulary (0 to {self.vocab - 1})"
            )
        if request.n > self.max_batch:
            raise GenerationError(
                f"n = {request.n} is more than this server's batch of {self.max_batch} choices"
            )
        request.params.validate(self.vocab)

    def submit(self, request: Request) -> None:
        """Queue ``request`` (checked first: :meth:`check`)."""
        self.check(request)
        with self._cond:
            if self._stopping:
                raise GenerationError("the engine is shutting down")
            self._inbox.append(request)
            self._cond.notify()

    def wake(self) -> None:
        """Let the engine look at its requests now (after a :meth:`Request.cancel`)."""
        with self._cond:
            self._cond.notify()

    def stats(self) -> dict[str, int]:
        """Requests waiting (queued or prefilling), choices running, cache bytes."""
        with self._cond:
            waiting = len(self._inbox) + len(self._waiting)
        cache = self._cache
        return {
            "waiting": waiting,
            "running": len(self._running),
            "kv_cache_bytes": cache.nbytes() if cache is not None else 0,
        }

    def start(self) -> None:
        """Run the engine in a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="llmkit-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the requests in flight, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def idle(self) -> bool:
        return not (self._inbox or self._waiting or self._running)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self.idle and not self._stopping:
                    self._cond.wait()
                if self.idle and self._stopping:
                    return
            self.step()

    # -- the engine's thread -----------------------------------------------------------------

    def step(self) -> None:
        """One iteration: take arrivals, drop cancelled requests, prefill, decode a token for
        every running choice. A request whose own work fails (its prompt's forward pass, a
        temperature that overflows) gets the error as an event and leaves; a failure of the
        batch's forward pass fails every request in flight. The engine stays ready for new
        ones either way."""
        with self._cond:
            self._waiting.extend(_Prefill(r) for r in self._inbox)
            self._inbox.clear()
        self.iterations += 1
        try:
            self._drop_cancelled()
            with torch.inference_mode(), parametrize.cached():
                self._prefill()
                if self._running:
                    self._decode()
        except Exception as exc:  # the batch's forward pass failed: fail what was in flight
            log.exception("serving: an engine step failed")
            self._fail_all(_message(exc))

    def _fail_all(self, message: str) -> None:
        """A step failed where no one request is to blame (the batch's forward pass)."""
        requests = {id(s.request): s.request for s in self._running}
        requests.update({id(p.request): p.request for p in self._waiting if p.started})
        for request in requests.values():
            _fail(request, message)
        self._waiting = deque(p for p in self._waiting if not p.started)
        self._running, self._cache, self._next = [], None, None

    def _drop_cancelled(self) -> None:
        if any(p.request.cancelled for p in self._waiting):
            self._waiting = deque(p for p in self._waiting if not p.request.cancelled)
        keep = [i for i, s in enumerate(self._running) if not s.request.cancelled]
        if len(keep) < len(self._running):
            self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        """Keep running rows ``keep``; free the others' cache rows."""
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._cache, self._next = None, None
            return
        assert self._cache is not None and self._next is not None
        index = torch.tensor(keep, device=self.device)
        self._cache.select(index)
        self._next = self._next.index_select(0, index)

    def _reserved(self) -> int:
        """Rows the running choices and the started prefills hold."""
        return len(self._running) + sum(p.request.n for p in self._waiting if p.started)

    def _prefill(self) -> None:
        """Feed up to ``prefill_tokens`` prompt tokens, in arrival order; a request starts
        only when its choices fit in the batch (no request overtakes an earlier one)."""
        budget = self.prefill_tokens
        ready: list[_Prefill] = []
        reserved = self._reserved()
        for pf in list(self._waiting):
            if budget <= 0:
                break
            if not pf.started:
                if reserved + pf.request.n > self.max_batch:
                    break
                reserved += pf.request.n
                pf.started = True
                pf.cache = self.model.new_cache()
            prompt = pf.request.prompt
            chunk = prompt[pf.done : pf.done + budget]
            budget -= len(chunk)
            try:  # a prompt's own forward pass fails that request alone
                self._feed(pf, chunk)
            except Exception as exc:
                self._waiting.remove(pf)
                _fail(pf.request, _message(exc))
                continue
            if pf.done == len(prompt):
                self._waiting.remove(pf)
                ready.append(pf)
        for pf in ready:
            try:
                self._admit(pf)
            except Exception as exc:
                _fail(pf.request, _message(exc))

    def _feed(self, pf: _Prefill, chunk: list[int]) -> None:
        want = pf.request.params.prompt_logprobs
        ids = torch.tensor([chunk], dtype=torch.long, device=self.device)
        logits = self.model(ids, cache=pf.cache, last_only=not want).logits[0]
        if want:
            top = pf.request.params.logprobs
            if pf.done == 0:
                pf.prompt.append(Token(chunk[0]))
            else:
                assert pf.carry is not None
                pf.prompt += prompt_tokens(pf.carry, chunk[:1], top)
            pf.prompt += prompt_tokens(logits[:-1], chunk[1:], top)
        pf.carry = logits[-1:]
        pf.done += len(chunk)

    def _admit(self, pf: _Prefill) -> None:
        """Start a prefilled request's choices: pick each one's first token, then join the
        batch with the rows of those that go on."""
        request, cache = pf.request, pf.cache
        assert cache is not None and pf.carry is not None
        n = request.n
        if pf.prompt:
            _emit(request, Event(0, prompt=pf.prompt))
        if request.params.max_tokens == 0:  # echo only: the prompt is the answer
            for i in range(n):
                _emit(request, Event(i, finish_reason="length"))
            return
        seqs = [Sequence(request, i, self.tokenizer, self.device) for i in range(n)]
        tokens, errors = choose_tokens(pf.carry.expand(n, -1), seqs)
        if errors:
            _fail(request, next(iter(errors.values())), by_request=_by_request(errors))
            return
        going: list[int] = []
        for i, (s, tok) in enumerate(zip(seqs, tokens)):
            _emit(request, s.add(tok, self.limit))
            if s.reason is None:
                going.append(i)
        if not going:
            return
        if n > 1 or len(going) < n:
            cache.reorder(torch.zeros(len(going), dtype=torch.long, device=self.device))
        nxt = torch.tensor([tokens[i].id for i in going], dtype=torch.long, device=self.device)
        if self._cache is None:
            self._cache, self._next = cache, nxt
        else:
            assert self._next is not None
            self._cache = KVCache.concatenate([self._cache, cache])
            self._next = torch.cat([self._next, nxt])
        self._running += [seqs[i] for i in going]

    def _decode(self) -> None:
        assert self._cache is not None and self._next is not None
        self.peak_rows = max(self.peak_rows, len(self._running))
        logits = self.model(self._next[:, None], cache=self._cache).logits[:, -1]
        tokens, errors = choose_tokens(logits, self._running)
        for i, message in errors.items():  # those requests fail; the batch goes on
            request = self._running[i].request
            if not request.cancelled:
                _fail(request, message, by_request=_by_request({i: message}))
        keep: list[int] = []
        for i, (s, tok) in enumerate(zip(self._running, tokens)):
            if s.request.cancelled:
                continue
            _emit(s.request, s.add(tok, self.limit))
            if s.reason is None:
                keep.append(i)
        self._next = torch.tensor([t.id for t in tokens], dtype=torch.long, device=self.device)
        if len(keep) < len(self._running):
            self._keep(keep)


def _message(exc: Exception) -> str:
    if not isinstance(exc, GenerationError):
        log.error("serving: a request failed", exc_info=exc)
        return f"{type(exc).__name__}: {exc}"
    return str(exc)


def _by_request(errors: dict[int, str]) -> bool:
    """Whether the errors of :func:`choose_tokens` are the request's settings' doing."""
    return all("temperature" in m for m in errors.values())


def _fail(request: Request, message: str, by_request: bool = False) -> None:
    """End ``request`` with an error: its choices leave the batch at the next step."""
    _emit(request, Event(0, error=message, error_by_request=by_request))
    request.cancel()


def _emit(request: Request, event: Event) -> None:
    """Hand ``event`` to its request; a request whose receiver is gone is cancelled."""
    try:
        request.emit(event)
    except Exception:  # the receiving side closed (a server shutting down)
        log.debug("serving: an event could not be delivered", exc_info=True)
        request.cancel()
