"""What the engine keeps per request and per choice, and how a batch of choices picks its next
tokens: each row with its own settings (temperature, top-k/top-p/min-p, penalties, logit bias)
and, when seeded, its own random stream."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from llmkit.inference.sampling import Sampling, apply_repetition_penalty, filter_logits
from llmkit.inference.streaming import RowText, TokenizerLike

#: The most alternatives a token's logprobs list (the OpenAI API's own bound is 20).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request's choices pick tokens. ``temperature = 0`` is greedy decoding;
    ``stop_ids`` end a choice (the tokenizer's EOS, a chat turn's end) unless
    ``ignore_eos``; ``logprobs`` asks for that many alternatives per token (0: the chosen
    token's log-probability only), ``prompt_logprobs`` for the prompt tokens' too."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def validate(self, vocab: int) -> None:
        """Raise :class:`~llmkit.inference.GenerationError` (a ``ValueError``) for a setting
        out of range; the shared ones are checked as ``llmkit generate`` checks them."""
        from llmkit.inference.checks import GenerationError

        Sampling(
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
        ).validate()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise GenerationError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise GenerationError(f"{name} must be in [-2, 2], got {value}")
        for token, bias in self.logit_bias:
            if not 0 <= token < vocab:
                raise GenerationError(
                    f"logit_bias: token id {token} is outside the vocabulary (0 to {vocab - 1})"
                )
            if not -100.0 <= bias <= 100.0:
                raise GenerationError(f"logit_bias: {bias} for token {token} is not in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Token:
    """A token of a choice (or of the prompt), with its log-probability under the model and
    the most likely alternatives when asked for."""

    id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class Event:
    """What the engine hands a request: for choice ``index``, new tokens, the text that
    became final, and the finish reason once it ended (``"stop"``: a stop id or string;
    ``"length"``: max_tokens or the context). ``prompt`` carries the prompt's tokens with
    their log-probabilities (once, first); ``error`` ends the request."""

    index: int
    tokens: list[Token] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt: list[Token] | None = None
    error: str | None = None
    #: Whose the error is: the request's (its settings: a 400) or the server's (a 500).
    error_by_request: bool = False


class Request:
    """A request as the engine sees it: prompt ids, settings, ``n`` choices and where its
    events go. ``emit`` is called from the engine's thread; :meth:`cancel` may be called
    from any thread (a client that went away)."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        emit: Callable[[Event], None],
        n: int = 1,
    ) -> None:
        self.prompt = [int(i) for i in prompt]
        self.params = params
        self.emit = emit
        self.n = n
        self.arrival = time.monotonic()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Sequence:
    """One choice of a request while it decodes: its new ids, its text (stop strings,
    incremental decoding) and its random stream (seeded: ``seed + index``, so choice 0 of a
    seeded request draws what ``llmkit generate --seed`` draws)."""

    def __init__(
        self, request: Request, index: int, tokenizer: TokenizerLike | None, device: torch.device
    ) -> None:
        self.request = request
        self.index = index
        self.params = request.params
        self.ids: list[int] = []
        self.text = (
            RowText(tokenizer, request.prompt, self.params.stop) if tokenizer is not None else None
        )
        self.generator: torch.Generator | None = None
        if self.params.seed is not None and not self.params.greedy:
            seed = (self.params.seed + index) % 2**64
            self.generator = torch.Generator(device=device).manual_seed(seed)
        self.reason: str | None = None

    @property
    def length(self) -> int:
        """Tokens in the context: the prompt and the new ones."""
        return len(self.request.prompt) + len(self.ids)

    def add(self, token: Token, limit: int) -> Event:
        """Append a chosen token; the event to emit (with the text that became final and,
        when this token ends the choice, the finish reason)."""
        self.ids.append(token.id)
        p = self.params
        if (token.id in p.stop_ids and not p.ignore_eos) or (
            self.text is not None and self.text.push(token.id)
        ):
            self.reason = "stop"
        elif len(self.ids) >= p.max_tokens or self.length >= limit:
            self.reason = "length"
        text = ""
        if self.text is not None:
            if self.reason is not None:
                self.text.finish()
            text = self.text.take(done=self.reason is not None)  # a stop id is never text
        return Event(self.index, [token], text, self.reason)


def _adjusted(scores: Tensor, seqs: list[Sequence]) -> Tensor:
    """The scores after each row's logit bias and penalties (OpenAI's presence and frequency
    penalties, CTRL's repetition penalty)."""
    vocab = scores.shape[-1]
    for i, s in enumerate(seqs):
        p = s.params
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=scores.device)
            bias = torch.tensor([b for _, b in p.logit_bias], device=scores.device)
            scores[i].index_add_(0, ids, bias.to(scores.dtype))
        if (p.presence_penalty or p.frequency_penalty) and s.ids:
            counts = torch.bincount(torch.tensor(s.ids, device=scores.device), minlength=vocab)
            counts = counts[:vocab].to(scores.dtype)
            scores[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(1, vocab, dtype=torch.bool, device=scores.device)
            seen[0, torch.tensor(s.request.prompt + s.ids, device=scores.device)] = True
            scores[i : i + 1] = apply_repetition_penalty(
                scores[i : i + 1], seen, p.repetition_penalty
            )
    return scores


def choose_tokens(logits: Tensor, seqs: list[Sequence]) -> tuple[list[Token], dict[int, str]]:
    """The next token of each row of ``logits`` (rows, vocab), by its choice's settings,
    and the rows that have none: row → why (NaN logits: the model; probabilities that
    overflowed: that row's temperature). Such a row fails alone; the others are chosen.

    Rows with equal settings are filtered together (:func:`~llmkit.inference.filter_logits`,
    as ``llmkit generate`` filters); a seeded row draws from its own stream."""
    scores = logits.float()
    errors: dict[int, str] = {}
    broken = scores.isnan().any(-1)
    if bool(broken.any()):
        for row in broken.nonzero().flatten().tolist():
            errors[row] = (
                "the model's logits hold NaN: its weights or activations are not finite "
                "(a diverged run, or an overflow in 16-bit precision)"
            )
        scores = scores.masked_fill(broken[:, None], 0.0)
    logp = None
    if any(s.params.logprobs is not None for s in seqs):
        logp = torch.log_softmax(scores, dim=-1)
    if any(
        s.params.logit_bias
        or s.params.presence_penalty
        or s.params.frequency_penalty
        or s.params.repetition_penalty != 1.0
        for s in seqs
    ):
        scores = _adjusted(scores.clone(), seqs)
    chosen = [0] * len(seqs)
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(seqs):
        p = s.params
        key = (0.0,) if p.greedy else (p.temperature, p.top_k, p.top_p, p.min_p)
        groups.setdefault(key, []).append(i)
    for key, rows in groups.items():
        index = torch.tensor(rows, device=scores.device)
        part = scores.index_select(0, index)
        if key == (0.0,):
            picked = part.argmax(-1).tolist()
        else:
            picked = _sample(part, key, [seqs[r] for r in rows], rows, errors)
        for r, t in zip(rows, picked):
            chosen[r] = int(t)
    tokens = [Token(t) for t in chosen]
    if logp is not None:
        for i, s in enumerate(seqs):
            n = s.params.logprobs
            if n is None or i in errors:
                continue
            tokens[i].logprob = float(logp[i, chosen[i]])
            if n:
                values, ids = logp[i].topk(n)
                tokens[i].top = list(zip(ids.tolist(), values.tolist()))
    return tokens, errors


def _sample(
    part: Tensor, key: tuple, seqs: list[Sequence], rows: list[int], errors: dict[int, str]
) -> list[int]:
    """Draw one token per row of ``part`` (rows of one sampling setting ``key``); a row
    whose probabilities are not finite is recorded in ``errors`` and draws nothing real."""
    temperature, top_k, top_p, min_p = key
    probs = filter_logits(part / temperature, top_k, top_p, min_p).softmax(-1)
    bad = probs.isnan().any(-1)
    if bool(bad.any()):
        for j in bad.nonzero().flatten().tolist():
            errors.setdefault(
                rows[j],
                f"no finite sampling probabilities: the logits divided by temperature "
                f"{temperature} overflow; use a larger temperature, or 0 for greedy decoding",
            )
        probs = probs.masked_fill(bad[:, None], 1.0)
    picked = [0] * len(rows)
    shared = [j for j, s in enumerate(seqs) if s.generator is None]
    if shared:
        sel = probs[shared] if len(shared) < len(rows) else probs
        for j, t in zip(shared, torch.multinomial(sel, 1).squeeze(-1).tolist()):
            picked[j] = t
    for j, s in enumerate(seqs):
        if s.generator is not None:
            picked[j] = int(torch.multinomial(probs[j : j + 1], 1, generator=s.generator))
    return picked


def prompt_tokens(logits: Tensor, ids: list[int], top: int | None) -> list[Token]:
    """Prompt tokens ``ids`` with their log-probabilities: ``logits[j]`` (len(ids), V) is
    the model's prediction of ``ids[j]``; ``top`` alternatives each when asked for."""
    if not ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(ids, device=logp.device)
    chosen = logp.gather(1, target[:, None]).squeeze(1).tolist()
    tops: list[list[tuple[int, float]] | None] = [None] * len(ids)
    if top:
        values, index = logp.topk(top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]
    return [Token(t, lp, tp) for t, lp, tp in zip(ids, chosen, tops)]
