"""Tensor rules between a Hugging Face state dict and llmkit's, one rule per llmkit tensor.

A :class:`Rule` names one llmkit tensor, the Hugging Face tensors it is made of, and the two
functions between them (a rename, a transpose, a concatenation of q/k/v rows, a stack of
experts). Each family module lists its rules for a given config; :func:`to_llmkit` and
:func:`to_hf` apply them and refuse, by name, any tensor that nothing maps.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.errors import LlmkitError

Join = Callable[[list[Tensor]], Tensor]
Split = Callable[[Tensor], list[Tensor]]


@dataclass(frozen=True)
class Rule:
    """llmkit tensor ``ours`` = ``join([hf[n] for n in theirs])``; ``split`` is the inverse."""

    ours: str
    theirs: tuple[str, ...]
    join: Join
    split: Split


def same(ours: str, theirs: str) -> Rule:
    """The same tensor under another name."""
    return Rule(ours, (theirs,), lambda ts: ts[0], lambda t: [t])


def transposed(ours: str, theirs: str) -> Rule:
    """A 2-D tensor stored transposed (GPT-2's ``Conv1D``: (in, out))."""
    return Rule(ours, (theirs,), lambda ts: ts[0].t(), lambda t: [t.t()])


def rows(ours: str, theirs: Sequence[str], sizes: Sequence[int]) -> Rule:
    """Several tensors stacked along their first dimension (q, k and v into one ``qkv``)."""
    sizes = list(sizes)
    return Rule(ours, tuple(theirs), lambda ts: torch.cat(ts, 0), lambda t: list(t.split(sizes, 0)))


def experts(ours: str, theirs: Sequence[Sequence[str]], sizes: Sequence[int]) -> Rule:
    """One (E, …) tensor from E experts' tensors, each the rows of ``theirs[e]`` stacked
    (gate and up into a gated expert's ``w_in``)."""
    names = tuple(n for per_expert in theirs for n in per_expert)
    k, sizes = len(theirs[0]), list(sizes)

    def join(ts: list[Tensor]) -> Tensor:
        return torch.stack([torch.cat(ts[e * k : (e + 1) * k], 0) for e in range(len(theirs))])

    def split(t: Tensor) -> list[Tensor]:
        return [part for expert in t.unbind(0) for part in expert.split(sizes, 0)]

    return Rule(ours, names, join, split)


def mapped(ours: str, theirs: str, forward: Callable[[Tensor], Tensor], back: Callable) -> Rule:
    """A tensor changed on the way in (``forward``) and back out (``back``)."""
    return Rule(ours, (theirs,), lambda ts: forward(ts[0]), lambda t: [back(t)])


def separate_qkv(ours: str, theirs: str, sizes: Sequence[int], *, bias: bool) -> list[Rule]:
    """llmkit's fused ``{ours}.weight`` (and ``.bias``) from transformers' separate
    ``{theirs}q_proj``, ``k_proj`` and ``v_proj`` (Llama's names, which most families share)."""
    parts = ("weight", "bias") if bias else ("weight",)
    return [rows(f"{ours}.{p}", [f"{theirs}{x}_proj.{p}" for x in "qkv"], sizes) for p in parts]


def gated_mlp(ours: str, theirs: str, *, bias: bool) -> list[Rule]:
    """A gated MLP's ``gate_proj``, ``up_proj`` and ``down_proj`` (transformers' names) as
    llmkit's ``gate_proj``, ``up_proj`` and ``out_proj``."""
    names = [("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("out_proj", "down_proj")]
    parts = ("weight", "bias") if bias else ("weight",)
    return [same(f"{ours}{a}.{p}", f"{theirs}{b}.{p}") for a, b in names for p in parts]


def qk_norms(ours: str, theirs: str) -> list[Rule]:
    """Per-head q/k norm gains (``{theirs}q_norm``) as the q/k transform's (``{ours}``)."""
    return [same(f"{ours}{x}_norm.weight", f"{theirs}{x}_norm.weight") for x in "qk"]


def _ignored(name: str, ignore: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in ignore)


def to_llmkit(
    rules: Sequence[Rule], hf: dict[str, Tensor], *, ignore: Iterable[str] = ()
) -> dict[str, Tensor]:
    """llmkit's tensors from a Hugging Face state dict; every HF tensor must be used (or
    match an ``ignore`` pattern: buffers such as rotary frequencies or causal masks)."""
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for rule in rules:
        missing = [n for n in rule.theirs if n not in hf]
        if missing:
            raise LlmkitError(f"the checkpoint has no tensor {missing[0]!r} (for {rule.ours})")
        out[rule.ours] = rule.join([hf[n] for n in rule.theirs])
        used.update(rule.theirs)
    extra = sorted(n for n in hf if n not in used and not _ignored(n, ignore))
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise LlmkitError(f"the checkpoint has a tensor nothing maps: {extra[0]!r}{more}")
    return out


def to_hf(rules: Sequence[Rule], ours: dict[str, Tensor]) -> dict[str, Tensor]:
    """A Hugging Face state dict from llmkit's tensors (each rule's ``split``)."""
    out: dict[str, Tensor] = {}
    for rule in rules:
        if rule.ours not in ours:
            raise LlmkitError(f"the model has no tensor {rule.ours!r}")
        parts = rule.split(ours[rule.ours])
        if len(parts) != len(rule.theirs):
            raise LlmkitError(f"{rule.ours}: split into {len(parts)}, not {len(rule.theirs)}")
        out.update(zip(rule.theirs, parts, strict=True))
    return out
