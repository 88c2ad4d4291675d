"""The end-of-training sample, generated from the model training left in memory."""

from __future__ import annotations

import dataclasses
from typing import Any


def sample_text(result: Any) -> str | None:
    """``train.sample_prompt`` and ``train.sample_tokens`` tokens continuing it (temperature
    0.8, top-k 50, seeded with ``train.seed``) from a :class:`TrainResult`'s in-memory model
    and tokenizer — the weights the run just saved, so nothing is read back from disk. None
    when ``sample_tokens`` is 0 or the result holds no model (ranks other than 0). An empty
    prompt starts from the document separator and runs across documents.

    A chat model (its tokenizer has a chat template) answers instead: the prompt as a user
    message; or, when a chat run has no prompt of its own (none set, or the one its
    ``train.init_from`` text base samples with, inherited through ``extends``: a base's
    ``def `` is no user message), the first user turn of its validation data."""
    from llmkit.inference import Generator, Sampling

    if result.model is None or result.tokenizer is None or result.spec is None:
        return None
    t = result.spec.spec.train
    if t.sample_tokens <= 0:
        return None
    sampling = Sampling(max_new_tokens=t.sample_tokens, temperature=0.8, top_k=50, seed=t.seed)
    gen = Generator(result.model, result.tokenizer)
    prompt = t.sample_prompt
    if getattr(result.tokenizer, "chat_template", None):
        ids = getattr(result, "chat_prompt", None)
        if ids and (not prompt or prompt == _text_base_prompt(result.spec)):
            return _answer(gen, ids, sampling)
        if prompt:
            reply = gen.chat([{"role": "user", "content": prompt}], sampling).text
            return f"[user] {prompt}\n[assistant] {reply}"
    if not prompt and sampling.eos_id is None:
        sampling = dataclasses.replace(sampling, ignore_eos=True)
    text = gen.generate(prompt, sampling)[0].text
    return prompt + text


def _answer(gen: Any, ids: list[int], sampling: Any) -> str:
    """The reply to a rendered conversation prompt (``ids``: the first validation
    conversation up to the assistant's first trained token), with its user turn."""
    tokenizer = gen.tokenizer
    reply = gen.generate([ids], gen.chat_sampling(sampling))[0].text.strip()
    shown = tokenizer.decode(ids)
    user = _user_turn(tokenizer, shown)
    if user is None:  # a system turn, or a template that renders otherwise: as rendered
        return f"[prompt, from the validation data] {shown}\n[assistant] {reply}"
    return f"[user, from the validation data] {user}\n[assistant] {reply}"


def _user_turn(tokenizer: Any, rendered: str) -> str | None:
    """The content of ``rendered`` when it is one user turn and the generation prompt in
    the tokenizer's template (found by rendering a placeholder); None otherwise."""
    mark = "\u2063"  # INVISIBLE SEPARATOR: in no template
    try:
        around = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    except Exception:  # a template that refuses this conversation: show the prompt as is
        return None
    head, found, tail = str(around).partition(mark)
    if not found or len(rendered) < len(head) + len(tail):
        return None
    if not (rendered.startswith(head) and rendered.endswith(tail)):
        return None
    return rendered[len(head) : len(rendered) - len(tail)].strip() or None


def _text_base_prompt(rs: Any) -> str | None:
    """The ``sample_prompt`` of the text model a run starts from (``train.init_from``: a
    run or a checkpoint of one without a chat template); None otherwise."""
    from llmkit.data.tokenizer import read_config
    from llmkit.errors import LlmkitError
    from llmkit.runs import open_run

    init_from = rs.spec.train.init_from
    if not init_from:
        return None
    try:
        base = open_run(init_from)
        if read_config(base.dir / "tokenizer_config.json")[0]:
            return None  # a chat base: its prompt is a user message too
    except (LlmkitError, OSError):
        return None
    train = base.raw.get("train") if isinstance(base.raw, dict) else None
    prompt = train.get("sample_prompt") if isinstance(train, dict) else None
    return prompt if isinstance(prompt, str) else None
