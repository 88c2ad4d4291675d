"""Text generation: greedy decoding, sampling and beam search over the KV cache.

Strategies: greedy (``temperature = 0``), temperature sampling with top-k, top-p (nucleus,
Holtzman et al. 2020) and min-p (Nguyen et al. 2024) filters, the CTRL repetition penalty
(Keskar et al. 2019), and beam search with a length penalty and early stopping. Generation
ends per row at an EOS id, at a stop string, or after ``max_new_tokens``.

Batches of prompts of different lengths are left-padded; the padding is masked out of
attention (``key_padding_mask``) and every row is positioned as if it were alone, so a
batched generation equals generating each prompt by itself.

When every component of the model can decode through a KV cache (``supports_kv_cache``)
each step feeds one token per row; otherwise each step runs a full forward over the last
``max_seq_len`` tokens. When the context reaches ``max_seq_len`` the cache is rebuilt from
the most recent half of it, so generation can go on as long as asked.

The Python API::

    gen = Generator("runs/tiny-...")                    # or Generator(model, tokenizer)
    gen.generate(["def ", "import"], max_new_tokens=50, temperature=0.8, top_p=0.95)
    # -> [GenerationResult(text=..., ids=[...], finish_reason="length"), ...]
    stream = gen.stream("def ", max_new_tokens=50)
    for piece in stream:                                # text as it is generated
        print(piece, end="", flush=True)
    stream.result                                       # the GenerationResult
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from llmkit.model import KVCache, Transformer

FinishReason = Literal["eos", "stop", "length"]


class TokenizerLike(Protocol):
    """What generation needs from a tokenizer (llmkit's, or anything shaped alike)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class Sampling:
    """How to pick tokens. The defaults sample from the model's distribution unchanged.

    ``temperature = 0`` is greedy decoding. Filters apply in the order repetition penalty,
    temperature, top-k, top-p, min-p. ``num_beams > 1`` selects beam search, which is
    deterministic: temperature and the filters do not apply to it (setting top_k, top_p or
    min_p with beams is an error); the repetition penalty does.
    """

    max_new_tokens: int = 100
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    #: End-of-sequence id(s); ``Generator`` defaults to its tokenizer's EOS.
    eos_id: int | Sequence[int] | None = None
    #: Never stop at EOS (benchmarks: always ``max_new_tokens``).
    ignore_eos: bool = False
    #: Stop when the generated text contains one of these; the text ends before it.
    stop: Sequence[str] = ()
    num_beams: int = 1
    #: Beam scores are sum(log p) / length**length_penalty (> 0 favours longer outputs).
    length_penalty: float = 1.0
    #: Beam search: stop a prompt once it has num_beams finished hypotheses (True), or once
    #: no running beam can still beat the worst finished one (False).
    early_stopping: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)

    def validate(self) -> None:
        """Raise ValueError for settings that make no sense."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be ≥ 0, got {self.max_new_tokens}")
        if self.temperature < 0 or math.isnan(self.temperature):
            raise ValueError(f"temperature must be ≥ 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be ≥ 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.num_beams < 1:
            raise ValueError(f"num_beams must be ≥ 1, got {self.num_beams}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.num_beams > 1:
            used = [n for n in ("top_k", "top_p", "min_p") if getattr(self, n) is not None]
            if used:
                raise ValueError(
                    f"beam search is deterministic; {', '.join(used)} only apply to sampling "
                    "(num_beams = 1)"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def eos_ids(self) -> set[int]:
        if self.ignore_eos or self.eos_id is None:
            return set()
        if isinstance(self.eos_id, int):
            return {self.eos_id}
        return {int(i) for i in self.eos_id}


@dataclass
class GenerationResult:
    """One generated continuation."""

    text: str  # the new text (no prompt, no EOS token, cut before a stop string)
    ids: list[int]  # the new token ids (an EOS id included; through the stop string's end)
    finish_reason: FinishReason  # "eos", "stop" (a stop string) or "length"
    prompt_ids: list[int] = field(default_factory=list)
    score: float | None = None  # beam search: the length-normalized log-probability


# -- logits processing -----------------------------------------------------------------------


def filter_logits(
    logits: Tensor, top_k: int | None, top_p: float | None, min_p: float | None = None
) -> Tensor:
    """Mask logits (B, V) outside the top-k, the nucleus of mass top-p, and the tokens
    whose probability is below ``min_p`` times the most likely one's (at least one token
    always survives)."""
    if top_k is not None and 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    if min_p is not None and min_p > 0:
        probs = logits.softmax(-1)
        floor = min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL's penalty (Keskar et al. 2019): logits (B, V) of tokens already in a row
    (``seen`` (B, V) bool) are divided by ``penalty`` when positive, multiplied when not."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


# -- text: incremental decoding and stop strings -----------------------------------------------


class IncrementalDecoder:
    """Turns a growing sequence of token ids into text deltas.

    Decodes a short window (the offsets of Hugging Face text-generation-inference): the
    text of ``ids[prefix:]`` minus the text of ``ids[prefix:read]``, so each step costs
    O(1) tokens. A byte-level BPE piece that ends inside a UTF-8 character decodes to
    U+FFFD; such a delta is held back until the character completes. The window starts
    with the last prompt tokens so tokenizers that treat the first token specially (a
    leading space) decode as they would in context.
    """

    CONTEXT = 4  # prompt tokens kept as decoding context

    def __init__(self, tokenizer: TokenizerLike, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = [int(i) for i in prompt_ids[-self.CONTEXT :]]
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if ids else ""

    def push(self, token: int) -> str:
        """Add a token; return the text that became final (possibly empty)."""
        self.ids.append(int(token))
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


class _RowText:
    """The generated text of one row, with stop-string detection and safe streaming."""

    def __init__(
        self, tokenizer: TokenizerLike, prompt_ids: Sequence[int], stops: Sequence[str]
    ) -> None:
        self.decoder = IncrementalDecoder(tokenizer, prompt_ids)
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.stop_at: int | None = None  # index in text where a stop string starts
        self.sent = 0  # characters handed out by take()

    def push(self, token: int) -> bool:
        """Add a token; True when the text now contains a stop string."""
        delta = self.decoder.push(token)
        if delta:
            self._add(delta)
        return self.stop_at is not None

    def _add(self, delta: str) -> None:
        start = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        if self.stops and self.stop_at is None:
            window = self.text[start:]
            hits = [i for i in (window.find(s) for s in self.stops) if i >= 0]
            if hits:
                self.stop_at = start + min(hits)

    def finish(self) -> None:
        if self.stop_at is None:
            rest = self.decoder.flush()
            if rest:
                self._add(rest)

    @property
    def final(self) -> str:
        return self.text if self.stop_at is None else self.text[: self.stop_at]

    def take(self, done: bool) -> str:
        """Text that can be shown now: never part of a stop string that may yet complete."""
        if self.stop_at is not None:
            end = self.stop_at
        elif done or not self.stops:
            end = len(self.text)
        else:
            end = len(self.text) - self._held(self.text)
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def _held(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        for n in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


@dataclass
class _Row:
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    reason: FinishReason | None = None
    text: _RowText | None = None
    score: float | None = None


# -- feeding the model ------------------------------------------------------------------------


class _Context:
    """The token context of a batch and how it reaches the model.

    Prompts are left-padded into a column buffer; every step appends one column. With a KV
    cache each step feeds one token per row, and the cache is rebuilt from the most recent
    half of the context when it reaches ``max_seq_len``; without one (a component that
    cannot cache) each step runs a full forward over the last ``max_seq_len`` columns.
    """

    def __init__(
        self, model: Transformer, prompts: list[list[int]], pad_id: int, new_tokens: int
    ) -> None:
        self.model = model
        self.device = _model_device(model)
        self.limit = model.config.max_seq_len
        self.use_cache = model.supports_kv_cache
        rows = [p[-self.limit :] for p in prompts]
        width = max(len(r) for r in rows)
        self.padded = any(len(r) < width for r in rows)
        cols = width + max(min(new_tokens, 4 * self.limit), 1)
        ids = torch.full((len(rows), cols), pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), cols, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, width - len(r) : width] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) : width] = True
        self.ids, self.mask = ids.to(self.device), mask.to(self.device)
        self.start, self.end = 0, width
        self.new_tokens = new_tokens
        self.cache: KVCache | None = None

    def _forward(self) -> Tensor:
        ids = self.ids[:, self.start : self.end]
        mask: Tensor | None = None
        if self.padded:
            mask = self.mask[:, self.start : self.end]
            if bool(mask.all()):
                mask, self.padded = None, False  # the padding has scrolled out of the context
        if self.use_cache:
            room = self.end - self.start + self.new_tokens
            self.cache = self.model.new_cache(capacity=min(self.limit, room))
            out = self.model(ids, cache=self.cache, key_padding_mask=mask, last_only=True)
        else:
            out = self.model(ids, key_padding_mask=mask, last_only=True)
        return out.logits[:, -1]

    def prefill(self) -> Tensor:
        """Logits (B, V) of the next token after the prompts."""
        return self._forward()

    def step(self, tokens: Tensor) -> Tensor:
        """Append one token per row (B,); return the logits (B, V) of the next."""
        if self.end == self.ids.shape[1]:
            self._make_room()
        self.ids[:, self.end] = tokens
        self.mask[:, self.end] = True
        self.end += 1
        self.new_tokens = max(self.new_tokens - 1, 0)
        if self.use_cache:
            assert self.cache is not None
            if self.cache.position < self.limit:
                return self.model(tokens[:, None], cache=self.cache).logits[:, -1]
            self.start = self.end - max(self.limit // 2, 1)
        else:
            self.start = max(0, self.end - self.limit)
        return self._forward()

    def _make_room(self) -> None:
        keep_ids = self.ids[:, self.start : self.end]
        keep_mask = self.mask[:, self.start : self.end]
        extra = max(min(self.new_tokens, 4 * self.limit), 1)
        self.ids = torch.cat([keep_ids, keep_ids.new_zeros(keep_ids.shape[0], extra)], 1)
        self.mask = torch.cat([keep_mask, keep_mask.new_zeros(keep_mask.shape[0], extra)], 1)
        self.end -= self.start
        self.start = 0

    def reorder(self, index: Tensor) -> None:
        """Keep rows ``index`` in that order (beam search)."""
        self.ids = self.ids.index_select(0, index)
        self.mask = self.mask.index_select(0, index)
        if self.cache is not None:
            self.cache.reorder(index)


#: On CPU, models llmkit loads for generation store the weights of the output head and of
#: every ``nn.Linear`` with at least as many outputs as inputs column-major (same values and
#: shapes, transposed strides; a tied token embedding shares the head's) while they decode
#: one or two rows at a time. x @ Wᵀ then runs as BLAS's non-transposed GEMV, which streams
#: such weights faster. Measured on a 2-core AMD EPYC (MKL, fp32, 2 threads), time per product
#: column-major / row-major: one row: GPT-2's 50257 × 768 head 0.57, 3072 × 768 0.66,
#: 2304 × 768 0.72, 768 × 768 0.93, but 768 × 3072 1.30 (so fewer outputs than inputs stays
#: row-major); two rows 0.50–0.85; four or more rows 0.96–1.48. So the layout follows the
#: number of rows a generation decodes (prompts × beams), switched at the start of a call
#: when it changes: a GPT-2-small greedy decode (1 × 32 prompt, 64 new tokens, one thread)
#: takes 2.06 s instead of 2.46 s. Set False to keep row-major.
COLUMN_MAJOR_ON_CPU = True
#: Decoding this many rows or fewer uses the column-major layout.
COLUMN_MAJOR_MAX_ROWS = 2


def _decoding_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights whose layout decoding chooses: the output head, and each ``nn.Linear``
    with out_features ≥ in_features, each once (tied weights are one parameter)."""
    found: dict[int, nn.Parameter] = {}
    head = getattr(model, "lm_head", None)
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 2 or w.device.type != "cpu":
            continue
        if mod is head or (isinstance(mod, nn.Linear) and w.shape[0] >= w.shape[1]):
            found.setdefault(id(w), w)
    return list(found.values())


def _set_layout(model: nn.Module, column_major: bool) -> None:
    if torch.is_inference_mode_enabled():  # the new storage must not be an inference tensor
        return
    with torch.no_grad():
        for w in _decoding_weights(model):
            is_col = w.shape[0] > 1 and w.stride() == (1, w.shape[0])
            if column_major and not is_col:
                w.data = w.data.t().contiguous().t()
            elif not column_major and not w.is_contiguous():
                w.data = w.data.contiguous()


def prepare_for_decoding(model: Transformer, column_major: bool = True, rows: int = 1) -> None:
    """Give a CPU model the decoding layout for ``rows`` rows at a time (see
    :data:`COLUMN_MAJOR_ON_CPU`) and let later generations switch it to fit their number of
    rows; ``column_major=False`` restores the usual layout and stops the switching.

    The CLI, ``Generator(path)`` and ``llmkit bench generate`` do this to the models they
    load; a model you pass in is left as it is unless you call this. The weights stay ordinary
    trainable parameters, but they are no longer contiguous, and safetensors' ``save_model``
    refuses non-contiguous shared tensors: restore before saving."""
    wanted = column_major and COLUMN_MAJOR_ON_CPU
    model._llmkit_decoding_layout = wanted  # type: ignore[attr-defined]
    _set_layout(model, wanted and rows <= COLUMN_MAJOR_MAX_ROWS)


def _fit_layout(model: nn.Module, rows: int) -> None:
    """Switch a model prepared by :func:`prepare_for_decoding` to the layout for ``rows``."""
    if getattr(model, "_llmkit_decoding_layout", False):
        _set_layout(model, rows <= COLUMN_MAJOR_MAX_ROWS)


def _model_device(model: Transformer) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


# -- the decoding loops -----------------------------------------------------------------------


def _sample_steps(
    model: Transformer,
    rows: list[_Row],
    cfg: Sampling,
    pad_id: int,
    ctx: _Context | None = None,
) -> Iterator[None]:
    """Greedy or sampled decoding of every row at once; updates ``rows`` and yields after
    each step (streaming reads the rows' text in between). ``ctx`` may be given to inspect
    it afterwards (benchmarks read its cache)."""
    eos = cfg.eos_ids()
    b = len(rows)
    if cfg.max_new_tokens == 0:
        for row in rows:
            row.reason = "length"
        return
    if ctx is None:
        ctx = _Context(model, [r.prompt for r in rows], pad_id, cfg.max_new_tokens)
    device = ctx.device
    gen = None
    if cfg.seed is not None and not cfg.greedy:
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
    logits = ctx.prefill()
    vocab = logits.shape[-1]
    seen = None
    if cfg.repetition_penalty != 1.0:
        seen = torch.zeros(b, vocab + 1, dtype=torch.bool, device=device)
        prompt = torch.where(ctx.mask[:, : ctx.end], ctx.ids[:, : ctx.end], vocab)
        seen.scatter_(1, prompt, True)
        seen = seen[:, :vocab]
    active = [True] * b
    pad = torch.full((b,), pad_id, dtype=torch.long, device=device)
    rows_index = torch.arange(b, device=device)
    for step in range(cfg.max_new_tokens):
        scores = logits.float()
        if seen is not None:
            scores = apply_repetition_penalty(scores, seen, cfg.repetition_penalty)
        if cfg.greedy:
            nxt = scores.argmax(-1)
        else:
            scores = filter_logits(scores / cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)
            nxt = torch.multinomial(scores.softmax(-1), 1, generator=gen).squeeze(-1)
        if not all(active):
            nxt = torch.where(torch.tensor(active, device=device), nxt, pad)
        if seen is not None:
            seen[rows_index, nxt] = True
        tokens = nxt.tolist()
        for i, row in enumerate(rows):
            if not active[i]:
                continue
            tok = tokens[i]
            row.ids.append(tok)
            if tok in eos:
                row.reason, active[i] = "eos", False
            elif row.text is not None and row.text.push(tok):
                row.reason, active[i] = "stop", False
        last = step == cfg.max_new_tokens - 1
        if last or not any(active):
            break
        yield
        logits = ctx.step(nxt)
    for row in rows:
        if row.reason is None:
            row.reason = "length"
    yield


def _beam_search(model: Transformer, rows: list[_Row], cfg: Sampling, pad_id: int) -> None:
    """Beam search (as in Hugging Face transformers): keep ``num_beams`` running beams per
    prompt; of the 2·K best extensions, those ending in EOS (or a stop string) become
    finished hypotheses scored sum(log p) / len**length_penalty."""
    k = cfg.num_beams
    eos = cfg.eos_ids()
    b = len(rows)
    if cfg.max_new_tokens == 0:
        for row in rows:
            row.reason = "length"
        return
    ctx = _Context(model, [r.prompt for r in rows], pad_id, cfg.max_new_tokens)
    device = ctx.device
    logits = ctx.prefill()
    vocab = logits.shape[-1]
    expand = torch.arange(b, device=device).repeat_interleave(k)
    ctx.reorder(expand)
    logits = logits.index_select(0, expand)
    seen = None
    if cfg.repetition_penalty != 1.0:
        seen = torch.zeros(b * k, vocab + 1, dtype=torch.bool, device=device)
        prompt = torch.where(ctx.mask[:, : ctx.end], ctx.ids[:, : ctx.end], vocab)
        seen.scatter_(1, prompt, True)
        seen = seen[:, :vocab]
    beam_scores = torch.full((b, k), float("-inf"), device=device)
    beam_scores[:, 0] = 0.0
    beam_ids: list[list[int]] = [[] for _ in range(b * k)]
    hyps: list[list[tuple[float, list[int], FinishReason]]] = [[] for _ in range(b)]
    done = [False] * b
    stops = rows[0].text.stops if rows and rows[0].text is not None else ()
    tokenizer = rows[0].text.decoder.tokenizer if rows and rows[0].text is not None else None

    def normalized(score: float, length: int) -> float:
        return score / (max(length, 1) ** cfg.length_penalty)

    def hits_stop(ids: list[int]) -> bool:
        if not stops or tokenizer is None:
            return False
        tail = ids[-(4 * max(len(s) for s in stops) + 2) :]
        text = tokenizer.decode(tail)
        return any(s in text for s in stops)

    def add_hyp(i: int, score: float, ids: list[int], reason: FinishReason) -> None:
        bucket = hyps[i]
        bucket.append((normalized(score, len(ids)), ids, reason))
        bucket.sort(key=lambda h: h[0], reverse=True)
        del bucket[k:]

    for step in range(cfg.max_new_tokens):
        logp = logits.float()
        if seen is not None:
            logp = apply_repetition_penalty(logp, seen, cfg.repetition_penalty)
        logp = torch.log_softmax(logp, dim=-1)
        cand = (beam_scores.view(-1, 1) + logp).view(b, k * vocab)
        top_scores, top_idx = torch.topk(cand, 2 * k, dim=1)
        top_scores_l, top_idx_l = top_scores.tolist(), top_idx.tolist()
        next_src: list[int] = []
        next_tok: list[int] = []
        next_score: list[float] = []
        cur_len = step + 1
        for i in range(b):
            if done[i]:  # keep the row's beams running on padding; they are never read
                next_src += [i * k + j for j in range(k)]
                next_tok += [pad_id] * k
                next_score += [0.0] * k
                continue
            chosen = 0
            for rank, (score, flat) in enumerate(zip(top_scores_l[i], top_idx_l[i])):
                if score == float("-inf"):
                    break
                src, tok = i * k + flat // vocab, flat % vocab
                ids = beam_ids[src] + [tok]
                ended: FinishReason | None = (
                    "eos" if tok in eos else "stop" if hits_stop(ids) else None
                )
                if ended is not None:
                    if rank < k:
                        add_hyp(i, score, ids, ended)
                    continue
                next_src.append(src)
                next_tok.append(tok)
                next_score.append(score)
                chosen += 1
                if chosen == k:
                    break
            while chosen < k:  # fewer live candidates than beams (tiny vocabularies)
                next_src.append(i * k)
                next_tok.append(pad_id)
                next_score.append(float("-inf"))
                chosen += 1
            if len(hyps[i]) == k:
                if cfg.early_stopping:
                    done[i] = True
                else:
                    best_running = max(next_score[-k:])
                    if normalized(best_running, cur_len) <= hyps[i][-1][0]:
                        done[i] = True
        beam_ids = [beam_ids[s] + [t] for s, t in zip(next_src, next_tok)]
        beam_scores = torch.tensor(next_score, device=device).view(b, k)
        if all(done) or step == cfg.max_new_tokens - 1:
            break
        index = torch.tensor(next_src, device=device)
        tokens = torch.tensor(next_tok, device=device)
        if seen is not None:
            seen = seen.index_select(0, index)
            seen[torch.arange(b * k, device=device), tokens] = True
        ctx.reorder(index)
        logits = ctx.step(tokens)

    final_scores = beam_scores.tolist()
    for i in range(b):
        if not done[i]:
            for j in range(k):
                if final_scores[i][j] > float("-inf"):
                    add_hyp(i, final_scores[i][j], beam_ids[i * k + j], "length")
        row = rows[i]
        if hyps[i]:
            row.score, row.ids, row.reason = hyps[i][0]
        else:
            row.ids, row.reason = [], "length"


# -- public functions -------------------------------------------------------------------------


def _run(
    model: Transformer,
    prompts: list[list[int]],
    cfg: Sampling,
    tokenizer: TokenizerLike | None,
    pad_id: int,
    track_text: bool,
) -> tuple[list[_Row], Iterator[None]]:
    cfg.validate()
    if cfg.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    if not prompts:
        raise ValueError("no prompts")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. a BOS or EOS id)")
    rows = [_Row(list(map(int, p))) for p in prompts]
    if tokenizer is not None and (track_text or cfg.stop):
        for row in rows:
            row.text = _RowText(tokenizer, row.prompt, cfg.stop)

    def steps() -> Iterator[None]:
        was_training = model.training
        model.eval()
        _fit_layout(model, len(rows) * max(cfg.num_beams, 1))
        try:
            with torch.inference_mode():
                if cfg.num_beams > 1:
                    _beam_search(model, rows, cfg, pad_id)
                    yield
                else:
                    yield from _sample_steps(model, rows, cfg, pad_id)
        finally:
            model.train(was_training)

    return rows, steps()


def _result(row: _Row, tokenizer: TokenizerLike | None, eos: set[int]) -> GenerationResult:
    text = ""
    if row.text is not None and row.score is None:
        row.text.finish()
        text = row.text.final
    elif tokenizer is not None:
        ids = row.ids[:-1] if row.reason == "eos" else row.ids
        text = tokenizer.decode(ids) if ids else ""
        if row.reason == "stop" and row.text is not None:
            hits = [i for i in (text.find(s) for s in row.text.stops) if i >= 0]
            text = text[: min(hits)] if hits else text
    return GenerationResult(text, list(row.ids), row.reason or "length", row.prompt, row.score)


def generate_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    cfg: Sampling,
    tokenizer: TokenizerLike | None = None,
    pad_id: int = 0,
) -> list[GenerationResult]:
    """Generate for prompts of token ids (lengths may differ); one result per prompt."""
    rows, steps = _run(model, [list(p) for p in prompts], cfg, tokenizer, pad_id, False)
    for _ in steps:
        pass
    return [_result(r, tokenizer, cfg.eos_ids()) for r in rows]


def generate_ids(model: Transformer, prompt: Tensor, cfg: Sampling) -> Tensor:
    """Continue ``prompt`` (B, T) by up to ``cfg.max_new_tokens`` tokens; returns the new
    ids (B, N), rows that ended early (EOS) padded with the EOS id."""
    results = generate_batch(model, prompt.tolist(), cfg)
    n = max((len(r.ids) for r in results), default=0)
    eos = sorted(cfg.eos_ids())
    fill = eos[0] if eos else 0
    out = torch.full((len(results), n), fill, dtype=torch.long, device=prompt.device)
    for i, r in enumerate(results):
        if r.ids:
            out[i, : len(r.ids)] = torch.tensor(r.ids, dtype=torch.long)
    return out


class TextStream:
    """Iterate to receive the text of a generation as it is produced; afterwards
    ``result`` holds the :class:`GenerationResult`. Stop strings are never shown, not even
    in part."""

    def __init__(self, row: _Row, steps: Iterator[None], tokenizer: TokenizerLike) -> None:
        self._row, self._steps, self._tokenizer = row, steps, tokenizer
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        row = self._row
        assert row.text is not None
        for _ in self._steps:
            piece = row.text.take(done=False)
            if piece:
                yield piece
        row.text.finish()
        piece = row.text.take(done=True)
        if piece:
            yield piece
        self.result = _result(row, self._tokenizer, set())

    def text(self) -> str:
        """Run to the end and return the whole text."""
        return "".join(self)


class Generator:
    """Generation from a run directory, a :class:`~llmkit.runs.LoadedRun`, or a model and
    tokenizer.

    ``sampling`` keyword arguments are the fields of :class:`Sampling`; a ``stop`` may be a
    string or a list. Unless ``eos_id`` is given, the tokenizer's EOS id ends a row. A model
    it loads (a path) or quantizes gets the decoding layout (:func:`prepare_for_decoding`).
    """

    def __init__(
        self,
        model: Transformer | Any,
        tokenizer: TokenizerLike | None = None,
        *,
        device: str | torch.device | None = None,
        quantize: str | None = None,
    ) -> None:
        owned = isinstance(model, str | Path)
        if owned:
            from llmkit.runs import load_run

            model = load_run(model, device=str(device) if device else "cpu")
        if not isinstance(model, Transformer) and hasattr(model, "model"):  # a LoadedRun
            tokenizer = tokenizer if tokenizer is not None else model.tokenizer
            model = model.model
        if device is not None:
            model = model.to(device)
        if quantize:
            from llmkit.inference.quantize import quantize_model

            model = quantize_model(model, quantize)
            owned = True  # a copy
        if owned:
            prepare_for_decoding(model)
        self.model: Transformer = model
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_id", None)
        self.eos_id: int | None = eos if isinstance(eos, int) else None
        self.pad_id = self.eos_id if self.eos_id is not None else 0

    def sampling(self, sampling: Sampling | None = None, **kwargs: Any) -> Sampling:
        """A :class:`Sampling` from defaults, ``sampling`` and keyword overrides, with the
        tokenizer's EOS filled in."""
        cfg = dataclasses.replace(sampling or Sampling(), **kwargs)
        if cfg.eos_id is None and self.eos_id is not None:
            cfg.eos_id = self.eos_id
        return cfg

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt; an empty prompt starts from the EOS (document start)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            ids = [int(i) for i in prompt]
        return ids or [self.pad_id]

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling: Sampling | None = None,
        **kwargs: Any,
    ) -> list[GenerationResult]:
        """Generate a continuation of each prompt (text or token ids), batched."""
        batch = _as_batch(prompts)
        cfg = self.sampling(sampling, **kwargs)
        ids = [self.encode(p) for p in batch]
        return generate_batch(self.model, ids, cfg, self.tokenizer, self.pad_id)

    def stream(
        self, prompt: str | Sequence[int], sampling: Sampling | None = None, **kwargs: Any
    ) -> TextStream:
        """A :class:`TextStream` of one prompt's continuation (sampling only, not beams)."""
        if self.tokenizer is None:
            raise ValueError("streaming text needs a tokenizer")
        cfg = self.sampling(sampling, **kwargs)
        if cfg.num_beams > 1:
            raise ValueError("beam search cannot stream: the best beam is known only at the end")
        rows, steps = _run(
            self.model, [self.encode(prompt)], cfg, self.tokenizer, self.pad_id, True
        )
        return TextStream(rows[0], steps, self.tokenizer)


def _as_batch(
    prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
) -> list[str | Sequence[int]]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, int) for p in items):
        return [items]  # one prompt of token ids
    return items
