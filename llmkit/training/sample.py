"""The end-of-training sample, generated from the model training left in memory."""

from __future__ import annotations

import dataclasses
from typing import Any


def sample_text(result: Any) -> str | None:
    """``train.sample_prompt`` and ``train.sample_tokens`` tokens continuing it (temperature
    0.8, top-k 50, seeded with ``train.seed``) from a :class:`TrainResult`'s in-memory model
    and tokenizer — the weights the run just saved, so nothing is read back from disk. None
    when ``sample_tokens`` is 0 or the result holds no model (ranks other than 0). An empty
    prompt starts from the document separator and runs across documents. A chat model (its
    tokenizer has a chat template) answers the prompt as a user message instead."""
    from llmkit.inference import Generator, Sampling

    if result.model is None or result.tokenizer is None or result.spec is None:
        return None
    t = result.spec.spec.train
    if t.sample_tokens <= 0:
        return None
    sampling = Sampling(max_new_tokens=t.sample_tokens, temperature=0.8, top_k=50, seed=t.seed)
    if not t.sample_prompt and sampling.eos_id is None:
        sampling = dataclasses.replace(sampling, ignore_eos=True)
    gen = Generator(result.model, result.tokenizer)
    if t.sample_prompt and getattr(result.tokenizer, "chat_template", None):
        reply = gen.chat([{"role": "user", "content": t.sample_prompt}], sampling).text
        return f"[user] {t.sample_prompt}\n[assistant] {reply}"
    text = gen.generate(t.sample_prompt, sampling)[0].text
    return t.sample_prompt + text
