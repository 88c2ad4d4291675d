"""The decoding loops: the rows of a batch, the context that feeds the model (KV cache or
full forwards), greedy/sampled decoding and beam search."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.utils import parametrize

from llmkit.inference.checks import GenerationError, check_memory
from llmkit.inference.layout import fit_layout
from llmkit.inference.sampling import (
    FinishReason,
    GenerationResult,
    Sampling,
    apply_repetition_penalty,
    filter_logits,
)
from llmkit.inference.streaming import RowText, TokenizerLike
from llmkit.model import KVCache, Transformer

#: The end of the decoding steps (``next``'s default).
_DONE = object()


@dataclass
class Row:
    """One prompt's generation in progress: its prompt, the new ids, why it ended, its
    text (when tracked) and, for beam search, the best hypothesis' score."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    reason: FinishReason | None = None
    text: RowText | None = None
    score: float | None = None

    def result(self, tokenizer: TokenizerLike | None) -> GenerationResult:
        """The finished row as a :class:`GenerationResult`."""
        text = ""
        if self.text is not None and self.score is None:
            self.text.finish()
            text = self.text.final
        elif tokenizer is not None:
            ids = self.ids[:-1] if self.reason == "eos" else self.ids
            text = tokenizer.decode(ids) if ids else ""
            if self.reason == "stop" and self.text is not None:
                hits = [i for i in (text.find(s) for s in self.text.stops) if i >= 0]
                text = text[: min(hits)] if hits else text
        return GenerationResult(
            text, list(self.ids), self.reason or "length", self.prompt, self.score
        )


def _prompt_tokens(rows: list[Row], vocab: int, device: torch.device) -> Tensor:
    """(rows, vocab) bool: the ids in each row's whole prompt (the repetition penalty's
    "already in the row"), also those before the last ``max_seq_len`` the model sees."""
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        ids = torch.tensor(row.prompt, dtype=torch.long, device=device).clamp_(0, vocab)
        seen[i, ids] = True
    return seen[:, :vocab]


def model_device(model: Transformer) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU if it has none."""
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


class DecodeContext:
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
        self.device = model_device(model)
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


def sample_steps(
    model: Transformer,
    rows: list[Row],
    cfg: Sampling,
    pad_id: int,
    ctx: DecodeContext | None = None,
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
        ctx = DecodeContext(model, [r.prompt for r in rows], pad_id, cfg.max_new_tokens)
    device = ctx.device
    gen = None
    if cfg.seed is not None and not cfg.greedy:
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
    logits = ctx.prefill()
    vocab = logits.shape[-1]
    seen = None
    if cfg.repetition_penalty != 1.0:
        seen = _prompt_tokens(rows, vocab, device)
    active = [True] * b
    pad = torch.full((b,), pad_id, dtype=torch.long, device=device)
    rows_index = torch.arange(b, device=device)
    for step in range(cfg.max_new_tokens):
        scores = logits.float()
        # 2: the model's logits hold NaN; 1: the probabilities do not (an overflow). Read
        # with the tokens (one transfer a step); a row's NaN never reaches torch.multinomial
        # (which fails on the CPU and asserts on CUDA).
        broken = scores.isnan().any(-1).long() * 2
        if seen is not None:
            scores = apply_repetition_penalty(scores, seen, cfg.repetition_penalty)
        if cfg.greedy:
            nxt = scores.argmax(-1)
        else:
            scores = filter_logits(scores / cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)
            probs = scores.softmax(-1)
            bad = probs.isnan().any(-1, keepdim=True)
            broken = torch.maximum(broken, bad.squeeze(-1).long())
            probs = probs.masked_fill(bad, 1.0)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        if not all(active):
            nxt = torch.where(torch.tensor(active, device=device), nxt, pad)
        if seen is not None:
            seen[rows_index, nxt] = True
        packed = torch.cat([nxt, broken]).tolist()
        tokens, flags = packed[:b], packed[b:]
        for i, row in enumerate(rows):
            if not active[i]:
                continue
            if flags[i]:
                raise _non_finite(step, i, flags[i] == 2, cfg)
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


def _non_finite(step: int, row: int, logits: bool, cfg: Sampling) -> GenerationError:
    """The error of a row whose next token cannot be chosen: NaN logits (the model's
    weights or activations), or probabilities that overflowed (temperature)."""
    where = f"step {step + 1}, prompt {row + 1}"
    if logits:
        return GenerationError(
            f"the model's logits hold NaN ({where}): its weights or activations are not "
            "finite (a diverged run, or an overflow in 16-bit precision)"
        )
    return GenerationError(
        f"no finite sampling probabilities ({where}): the logits divided by temperature "
        f"{cfg.temperature} overflow; use a larger temperature, or 0 for greedy decoding"
    )


def beam_search(model: Transformer, rows: list[Row], cfg: Sampling, pad_id: int) -> None:
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
    ctx = DecodeContext(model, [r.prompt for r in rows], pad_id, cfg.max_new_tokens)
    device = ctx.device
    logits = ctx.prefill()
    vocab = logits.shape[-1]
    expand = torch.arange(b, device=device).repeat_interleave(k)
    ctx.reorder(expand)
    logits = logits.index_select(0, expand)
    seen = None
    if cfg.repetition_penalty != 1.0:
        seen = _prompt_tokens(rows, vocab, device).index_select(0, expand)
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
            if any(s != s for s in top_scores_l[i]):  # NaN (topk ranks it first)
                raise _non_finite(step, i, True, cfg)
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


def _check_ids(rows: list[Row], pad_id: int, vocab: int) -> None:
    """Refuse token ids outside the model's vocabulary (an embedding lookup would fail,
    on CUDA with a device-side assert)."""
    if not 0 <= pad_id < vocab:
        raise GenerationError(f"pad_id {pad_id} is outside the vocabulary (0 to {vocab - 1})")
    for i, row in enumerate(rows):
        low, high = min(row.prompt), max(row.prompt)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise GenerationError(
                f"prompt {i + 1}: token id {bad} is outside the model's vocabulary "
                f"(0 to {vocab - 1})"
            )


def start_decoding(
    model: Transformer,
    prompts: list[list[int]],
    cfg: Sampling,
    tokenizer: TokenizerLike | None,
    pad_id: int,
    track_text: bool,
) -> tuple[list[Row], Iterator[None]]:
    """Validate, then set up one :class:`Row` per prompt and the steps that decode them
    (sampling or beam search, in eval mode under ``torch.inference_mode``, each adapted
    weight computed once a step, or once in all when the caller holds
    ``parametrize.cached()`` around them; iterating runs them). ``track_text`` keeps each
    row's text (streaming)."""
    cfg.validate()
    if cfg.stop and tokenizer is None:
        raise GenerationError("stop strings need a tokenizer")
    if not prompts:
        raise GenerationError("no prompts")
    if any(len(p) == 0 for p in prompts):
        raise GenerationError("every prompt needs at least one token (e.g. a BOS or EOS id)")
    rows = [Row(list(map(int, p))) for p in prompts]
    _check_ids(rows, pad_id, model.config.vocab_size)
    width = max(min(len(r.prompt), model.config.max_seq_len) for r in rows)
    penalty = cfg.repetition_penalty != 1.0
    beams = cfg.num_beams
    check_memory(model, len(rows), beams, width, cfg.max_new_tokens, penalty, model_device(model))
    if tokenizer is not None and (track_text or cfg.stop):
        for row in rows:
            row.text = RowText(tokenizer, row.prompt, cfg.stop)

    def decoding() -> Iterator[None]:
        if cfg.num_beams > 1:
            beam_search(model, rows, cfg, pad_id)
            yield
        else:
            yield from sample_steps(model, rows, cfg, pad_id)

    def steps() -> Iterator[None]:
        # Each step runs under inference mode with the adapted weights (parametrizations:
        # LoRA, DoRA) computed once; neither is held across a ``yield``, so the caller's
        # code between steps (a streaming loop's body) runs in its own grad mode. The model
        # stays in eval mode until the steps end or are closed (a stream left early).
        was_training = model.training
        model.eval()
        fit_layout(model, len(rows) * max(cfg.num_beams, 1))
        inner = decoding()
        try:
            while True:
                with torch.inference_mode(), parametrize.cached():
                    if next(inner, _DONE) is _DONE:
                        return
                yield
        finally:
            inner.close()
            model.train(was_training)

    return rows, steps()
