"""Generation from token ids (:func:`generate_batch`, :func:`generate_ids`) and from text
(:class:`Generator`: a run directory, a loaded run, or a model and tokenizer)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils import parametrize

from llmkit.inference.checks import GenerationError, check_text, check_weights
from llmkit.inference.decode import start_decoding
from llmkit.inference.layout import prepare_for_decoding
from llmkit.inference.sampling import GenerationResult, Sampling
from llmkit.inference.streaming import TextStream, TokenizerLike
from llmkit.model import Transformer


def generate_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    cfg: Sampling,
    tokenizer: TokenizerLike | None = None,
    pad_id: int = 0,
) -> list[GenerationResult]:
    """Generate for prompts of token ids (lengths may differ); one result per prompt."""
    rows, steps = start_decoding(model, [list(p) for p in prompts], cfg, tokenizer, pad_id, False)
    # No caller code runs between these steps: the parametrization cache every step enters
    # is held for all of them, so each adapted weight (LoRA, DoRA) is computed once per
    # generation. (Not inference mode: the weight layout switches before the first step.)
    with parametrize.cached():
        for _ in steps:
            pass
    return [r.result(tokenizer) for r in rows]


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


class Generator:
    """Generation from a run directory, a :class:`~llmkit.runs.LoadedRun`, or a model and
    tokenizer.

    ``sampling`` keyword arguments are the fields of :class:`Sampling`; a ``stop`` may be a
    string or a list. Unless ``eos_id`` is given, the tokenizer's EOS id ends a row. A model
    it loads (a path) or quantizes gets the decoding layout (:func:`prepare_for_decoding`).
    ``quantize`` (``"int8"``, ``"int8-weight-only"``, ``"bf16"`` or ``"auto"``) decodes a
    converted copy (:func:`~llmkit.inference.quantize.quantize_model`).
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
            # Weights read from files are checked once: NaN or infinity in one is named here
            # (decoding would only see NaN logits); a model passed in is the caller's.
            check_weights(model.model, getattr(model, "weights", None))
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
            from llmkit.data.long_text import encode_long  # any length, in bounded pieces

            ids = encode_long(self.tokenizer, prompt).tolist() if prompt else []
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
        for i, p in enumerate(batch):
            if isinstance(p, str):
                check_text(p, f"prompt {i + 1}" if len(batch) > 1 else "the prompt")
        ids = [self.encode(p) for p in batch]
        return generate_batch(self.model, ids, cfg, self.tokenizer, self.pad_id)

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The ids of ``messages`` in the tokenizer's chat template, ending with the
        assistant's turn opened; a ``ValueError`` when the tokenizer has no template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise GenerationError("the tokenizer has no chat template (tokenizer_config.json)")
        for i, message in enumerate(messages):
            for key, value in message.items():
                if isinstance(value, str):
                    check_text(value, f"message {i + 1} {key}")
        return list(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True))

    def chat_sampling(self, sampling: Sampling | None = None, **kwargs: Any) -> Sampling:
        """:meth:`sampling` that also stops at the end of the assistant's turn."""
        cfg = dataclasses.replace(sampling or Sampling(), **kwargs)
        if not cfg.ignore_eos and cfg.eos_id is None:
            stops = getattr(self.tokenizer, "stop_ids", None)
            cfg = dataclasses.replace(cfg, eos_id=stops or self.eos_id)
        return cfg

    def chat(
        self, messages: Sequence[dict[str, str]], sampling: Sampling | None = None, **kwargs: Any
    ) -> GenerationResult:
        """The assistant's reply to ``messages`` (``{"role", "content"}`` dicts) with the
        tokenizer's chat template, stopped at the end of its turn; the text stripped."""
        cfg = self.chat_sampling(sampling, **kwargs)
        result = self.generate([self.chat_prompt(messages)], cfg)[0]
        return dataclasses.replace(result, text=result.text.strip())

    def stream(
        self, prompt: str | Sequence[int], sampling: Sampling | None = None, **kwargs: Any
    ) -> TextStream:
        """A :class:`TextStream` of one prompt's continuation (sampling only, not beams)."""
        if self.tokenizer is None:
            raise GenerationError("streaming text needs a tokenizer")
        cfg = self.sampling(sampling, **kwargs)
        if cfg.num_beams > 1:
            raise GenerationError(
                "beam search cannot stream: the best beam is known only at the end"
            )
        if isinstance(prompt, str):
            check_text(prompt, "the prompt")
        rows, steps = start_decoding(
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
