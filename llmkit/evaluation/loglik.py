"""Log-likelihood of continuations given contexts: the scoring every downstream task uses.

A request is a (context, continuation) pair. Its score is the sum of the log-probabilities
of the continuation's tokens after the context, and whether greedy decoding would have
produced exactly those tokens.

Text pairs are tokenized as lm-eval-harness does, so scores compare with it: whitespace at
the end of the context moves to the front of the continuation, the context is encoded
alone, the whole text is encoded, and the continuation is the whole text's tokens past the
context's. An empty context starts from the tokenizer's EOS (the document start).

Requests are batched, longest first. Requests sharing a context (the choices of one
multiple-choice question) are scored through the KV cache when the model supports it: the
context is fed once, its cache copied to one row per choice, and only the continuations are
fed after it. Both paths give the same numbers up to float rounding (tested).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from llmkit.data.long_text import encode_long

#: A context shared by at least this many requests goes through the KV cache.
SHARED_CONTEXT_MIN = 2


@dataclass(frozen=True)
class TokenRequest:
    """A continuation's ids after a context's ids (the context may be empty only if the
    continuation then starts from a prefix token the caller put in the context)."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


@dataclass(frozen=True)
class Loglik:
    """The score of one request: ``logprob`` (nats, summed over the continuation), whether
    greedy decoding reproduces the continuation, and the number of scored tokens."""

    logprob: float
    greedy: bool
    tokens: int


class LoglikScorer:
    """Scores requests with a model and its tokenizer.

    ``max_length`` (default: the model's ``max_seq_len``) bounds what one forward sees: a
    longer context loses its oldest tokens. ``use_cache`` False scores every request with a
    full forward.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        batch_size: int = 16,
        max_length: int | None = None,
        use_cache: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = max(1, int(batch_size))
        self.max_length = int(max_length or model.spec.model.max_seq_len)
        self.use_cache = use_cache and bool(getattr(model, "supports_kv_cache", False))
        self.device = next(model.parameters()).device

    # -- tokenization ------------------------------------------------------------------

    @property
    def prefix_id(self) -> int:
        """The token an empty context stands for: the tokenizer's EOS."""
        eos = getattr(self.tokenizer, "eos_id", None)
        if eos is None:
            raise ValueError(
                "an empty context needs a document-start token, and this tokenizer has no "
                "special token (train it with special_tokens, e.g. <|endoftext|>)"
            )
        return int(eos)

    def _encode(self, text: str) -> list[int]:
        """The ids of ``text``, a long one encoded in pieces (:func:`encode_long`)."""
        return encode_long(self.tokenizer, text).tolist()

    def encode_pair(self, context: str, continuation: str) -> TokenRequest:
        """The ids of a text pair, split at the context as lm-eval-harness splits them."""
        if not continuation:
            raise ValueError("an empty continuation has nothing to score")
        if not context:
            return TokenRequest((self.prefix_id,), tuple(self._encode(continuation)))
        stripped = context.rstrip()
        if len(stripped) < len(context):
            continuation = context[len(stripped) :] + continuation
            context = stripped
        whole = self._encode(context + continuation)
        ctx = self._encode(context)
        cont = whole[len(ctx) :]
        if not cont:
            raise ValueError(f"the continuation {continuation!r} encodes to no tokens")
        if not ctx:
            ctx = [self.prefix_id]
        return TokenRequest(tuple(ctx), tuple(cont))

    def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[Loglik]:
        """Scores of text (context, continuation) pairs, in order."""
        return self.score([self.encode_pair(c, x) for c, x in pairs])

    # -- whole texts -------------------------------------------------------------------

    @torch.no_grad()
    def rolling(self, text: str | Sequence[int], *, stride: int | None = None) -> Loglik:
        """The log-likelihood of a whole text (or ids), every token scored once from the
        document start (the prefix token) in sliding windows of ``max_length`` that move by
        ``stride`` tokens (default ``max_length``: disjoint windows, lm-eval-harness's
        ``loglikelihood_rolling``); ``greedy`` says whether greedy decoding reproduces it."""
        from llmkit.evaluation.perplexity import sliding_batches

        ids = encode_long(self.tokenizer, text) if isinstance(text, str) else text
        if not len(ids):
            raise ValueError("an empty text has nothing to score")
        body = np.asarray(ids, dtype=np.int32)  # compact; the batches are int64
        tokens = torch.from_numpy(np.concatenate([np.int32([self.prefix_id]), body]))
        stride = stride or self.max_length
        total, count, greedy = 0.0, 0, True
        was_training = self.model.training
        self.model.eval()
        try:
            for x, y in sliding_batches(tokens, self.max_length, stride, self.batch_size):
                logits = self.model(x.to(self.device)).logits.float()
                y = y.to(self.device)
                keep = y != -100
                logp = F.log_softmax(logits[keep], dim=-1)
                target = y[keep]
                total += float(logp.gather(1, target[:, None]).sum())
                greedy = greedy and bool((logp.argmax(-1) == target).all())
                count += int(target.numel())
        finally:
            self.model.train(was_training)
        return Loglik(total, greedy, count)

    # -- scoring -----------------------------------------------------------------------

    @torch.no_grad()
    def score(self, requests: Sequence[TokenRequest]) -> list[Loglik]:
        """Scores of token requests, in order."""
        for r in requests:
            if not r.continuation:
                raise ValueError("an empty continuation has nothing to score")
            if len(r.continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(r.continuation)} tokens is longer than the "
                    f"model's context ({self.max_length})"
                )
            if not r.context:
                raise ValueError("a request needs at least one context token")
        out: list[Loglik | None] = [None] * len(requests)
        full: list[int] = []
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(requests):
            fits = len(r.context) + len(r.continuation) - 1 <= self.max_length
            if self.use_cache and fits:
                groups.setdefault(r.context, []).append(i)
            else:
                full.append(i)
        shared: list[tuple[tuple[int, ...], list[int]]] = []
        for ctx, members in groups.items():
            if len(members) >= SHARED_CONTEXT_MIN:
                shared.append((ctx, members))
            else:
                full.extend(members)
        was_training = self.model.training
        self.model.eval()
        try:
            self._score_full(requests, full, out)
            self._score_shared(requests, shared, out)
        finally:
            self.model.train(was_training)
        return [r for r in out if r is not None]

    def _score_full(
        self, requests: Sequence[TokenRequest], index: list[int], out: list[Loglik | None]
    ) -> None:
        """One forward per batch over context + continuation (the context cut from the
        left to fit), longest first."""
        rows = []
        for i in index:
            r = requests[i]
            whole = (r.context + r.continuation)[-(self.max_length + 1) :]
            rows.append((i, whole[:-1], r.continuation))
        rows.sort(key=lambda row: -len(row[1]))
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            width = len(batch[0][1])
            x = torch.zeros((len(batch), width), dtype=torch.long)
            for b, (_, inp, _) in enumerate(batch):
                x[b, : len(inp)] = torch.tensor(inp)
            logits = self.model(x.to(self.device)).logits
            for b, (i, inp, cont) in enumerate(batch):
                end = len(inp)
                out[i] = _score_rows(logits[b, end - len(cont) : end], cont)

    def _score_shared(
        self,
        requests: Sequence[TokenRequest],
        groups: list[tuple[tuple[int, ...], list[int]]],
        out: list[Loglik | None],
    ) -> None:
        """Groups of requests with one context: the contexts of up to ``batch_size``
        groups are fed once (left-padded), their caches copied to one row per request, then
        the continuations are fed (right-padded)."""
        groups = sorted(groups, key=lambda g: -len(g[0]))
        start = 0
        while start < len(groups):
            # as many groups as keep the continuation batch within batch_size rows
            stop, rows = start, 0
            while stop < len(groups) and (
                stop == start or rows + len(groups[stop][1]) <= self.batch_size
            ):
                rows += len(groups[stop][1])
                stop += 1
            self._score_group_batch(requests, groups[start:stop], out)
            start = stop

    def _score_group_batch(
        self,
        requests: Sequence[TokenRequest],
        groups: list[tuple[tuple[int, ...], list[int]]],
        out: list[Loglik | None],
    ) -> None:
        width = max(len(ctx) for ctx, _ in groups)
        x = torch.zeros((len(groups), width), dtype=torch.long)
        mask = torch.zeros((len(groups), width), dtype=torch.bool)
        for g, (ctx, _) in enumerate(groups):
            x[g, width - len(ctx) :] = torch.tensor(ctx)
            mask[g, width - len(ctx) :] = True
        cache = self.model.new_cache()
        padded = bool((~mask).any())
        first = self.model(
            x.to(self.device),
            cache=cache,
            key_padding_mask=mask.to(self.device) if padded else None,
            last_only=True,
        ).logits[:, -1]  # (G, V): the distribution of each continuation's first token
        members = [(g, i) for g, (_, idx) in enumerate(groups) for i in idx]
        owner = torch.tensor([g for g, _ in members], device=self.device)
        conts = [requests[i].continuation for _, i in members]
        longest = max(len(c) for c in conts)
        rest: Tensor | None = None
        if longest > 1:
            cache.reorder(owner)
            y = torch.zeros((len(members), longest - 1), dtype=torch.long)
            for b, c in enumerate(conts):
                y[b, : len(c) - 1] = torch.tensor(c[:-1])
            rest = self.model(y.to(self.device), cache=cache).logits
        for b, ((g, i), cont) in enumerate(zip(members, conts)):
            rows = first[g : g + 1]
            if rest is not None and len(cont) > 1:
                rows = torch.cat([rows, rest[b, : len(cont) - 1]], dim=0)
            out[i] = _score_rows(rows, cont)


def _score_rows(logits: Tensor, continuation: Iterable[int]) -> Loglik:
    """The score of ``continuation`` from the logits (T, V) predicting each of its tokens."""
    target = torch.tensor(list(continuation), device=logits.device)
    logp = F.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(1, target[:, None]).squeeze(1)
    greedy = bool((logp.argmax(-1) == target).all())
    return Loglik(float(picked.sum()), greedy, int(target.numel()))
