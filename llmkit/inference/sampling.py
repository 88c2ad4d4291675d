"""How tokens are chosen: the sampling settings, the result record, and the logits filters
(top-k, top-p (Holtzman et al. 2020), min-p (Nguyen et al. 2024), the CTRL repetition penalty
(Keskar et al. 2019))."""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from llmkit.inference.checks import GenerationError, text_problem

FinishReason = Literal["eos", "stop", "length"]


#: The most new tokens one generation may ask for: a million tokens is far past any context
#: window llmkit trains, and every row keeps its ids (and beam search each beam's) in lists.
MAX_NEW_TOKENS = 1_000_000
#: The most beams: published beam search uses a handful (4 to 16), and each step's
#: bookkeeping runs in Python per beam (the memory check comes on top, see
#: :func:`~llmkit.inference.checks.check_memory`).
MAX_NUM_BEAMS = 256


def _integer(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in [low, high]; :class:`GenerationError` otherwise (a bool is not
    a count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise GenerationError(f"{name} must be an integer, got {value!r}")
    n = int(value)
    if (low is not None and n < low) or (high is not None and n > high):
        bound = f"≥ {low}" if high is None else f"in [{low:,}, {high:,}]"
        raise GenerationError(f"{name} must be {bound}, got {n}")
    return n


def _real(name: str, value: object) -> float:
    """``value`` as a finite float; :class:`GenerationError` for another type, NaN or ±inf."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise GenerationError(f"{name} must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x):
        raise GenerationError(f"{name} must be a finite number, got {x}")
    return x


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
        """Raise :class:`~llmkit.inference.checks.GenerationError` (a ``ValueError``) for
        settings that make no sense or cannot run: a wrong type, NaN or infinity, a value
        out of range, more than :data:`MAX_NEW_TOKENS` new tokens or :data:`MAX_NUM_BEAMS`
        beams."""
        _integer("max_new_tokens", self.max_new_tokens, 0, MAX_NEW_TOKENS)
        temperature = _real("temperature", self.temperature)
        if temperature < 0:
            raise GenerationError(f"temperature must be ≥ 0 (0 = greedy), got {temperature}")
        if self.top_k is not None:
            _integer("top_k", self.top_k, 1)
        if self.top_p is not None and not 0 < _real("top_p", self.top_p) <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= _real("min_p", self.min_p) <= 1:
            raise GenerationError(f"min_p must be in [0, 1], got {self.min_p}")
        if _real("repetition_penalty", self.repetition_penalty) <= 0:
            raise GenerationError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _real("length_penalty", self.length_penalty)
        if self.seed is not None:
            _integer("seed", self.seed, -(2**63), 2**64 - 1)
        _integer("num_beams", self.num_beams, 1, MAX_NUM_BEAMS)
        if self.eos_id is not None:
            ids = [self.eos_id] if isinstance(self.eos_id, numbers.Integral) else self.eos_id
            if isinstance(ids, str | bytes) or not isinstance(ids, Collection):
                raise GenerationError(f"eos_id must be a token id or ids, got {self.eos_id!r}")
            for i in ids:
                _integer("eos_id", i)  # any integer: one outside the vocabulary never ends
        for s in self.stop:
            if not isinstance(s, str):
                raise GenerationError(f"stop strings must be text, got {s!r}")
            if not s:
                raise GenerationError("stop strings must not be empty")
            problem = text_problem(s)
            if problem is not None:
                raise GenerationError(f"stop string {s!r}: {problem}")
        if self.num_beams > 1:
            used = [n for n in ("top_k", "top_p", "min_p") if getattr(self, n) is not None]
            if used:
                raise GenerationError(
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
