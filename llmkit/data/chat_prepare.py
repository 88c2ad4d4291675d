"""Preparing chat data besides its token files: the chat template's special tokens in the
tokenizer spec, the rendered conversations a tokenizer learns from, and the template
attached to (and checked against) the run's tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmkit.data.chat import ChatTemplateError
from llmkit.data.tokenizer import UNK, Tokenizer
from llmkit.errors import LlmkitError

if TYPE_CHECKING:
    import datasets

    from llmkit.spec import TokenizerSpec

__all__ = [
    "attach_template",
    "iter_chat_texts",
    "template_has_unknown_text",
    "template_tokens",
    "with_template_tokens",
]

_RENDER_BATCH = 4096  # conversations rendered per batch


def with_template_tokens(spec: TokenizerSpec, chat: Any) -> TokenizerSpec:
    """The tokenizer spec with the chat template's special tokens after its own (the first
    one stays the document separator)."""
    tokens = list(dict.fromkeys([*spec.special_tokens, *chat.special_tokens]))
    return spec.model_copy(update={"special_tokens": tokens})


def template_tokens(spec: TokenizerSpec, chat: Any) -> dict[str, str | None]:
    """The template's token variables before the tokenizer exists (as
    :meth:`Tokenizer.template_tokens` gives them after)."""
    eos = spec.special_tokens[0] if spec.special_tokens else None
    return {"eos_token": chat.end_of_turn or eos, "pad_token": eos}


def iter_chat_texts(
    ds: datasets.Dataset, seed: int, chat: Any, spec: TokenizerSpec
) -> Iterator[str]:
    """The conversations of ``ds`` rendered with the template, special tokens removed (the
    tokenizer adds those itself), in a seeded shuffled order: what a tokenizer learns from."""
    from llmkit.data.chat import render

    tokens = template_tokens(spec, chat)
    ds = ds.select_columns(["messages", "where"]).shuffle(seed=seed, keep_in_memory=True)
    for batch in ds.iter(batch_size=_RENDER_BATCH):
        for conv, where in zip(batch["messages"], batch["where"]):
            try:
                text = render(chat.template, json.loads(conv), tokens=tokens)
            except ChatTemplateError as exc:
                raise ChatTemplateError(f"{where}: {exc}") from None
            for special in spec.special_tokens:
                text = text.replace(special, "")
            if text:
                yield text


def attach_template(
    tokenizer: Tokenizer,
    chat: Any,
    run_dir: Path,
    log: Callable[[str], None],
    *,
    add_tokens: bool = False,
) -> None:
    """Check the tokenizer has every token the template needs (with ``add_tokens``, add the
    missing ones as special tokens to the run's copy: a fine-tune growing its vocabulary),
    give it the template and write the run's ``tokenizer_config.json``."""
    where = f"data.source.template {chat.name!r}"
    missing = [t for t in chat.special_tokens if tokenizer.token_to_id(t) is None]
    if missing and add_tokens:
        before = tokenizer.vocab_size
        tokenizer.tok.add_special_tokens(missing)
        tokenizer.save(run_dir / "tokenizer.json")
        log(
            f"data: added the template's tokens {', '.join(missing)} to the tokenizer "
            f"({before} -> {tokenizer.vocab_size} tokens)"
        )
    elif missing:
        raise LlmkitError(
            f"{where} needs the token {missing[0]!r}, which the tokenizer lacks (it is added "
            "when a tokenizer is trained, or to a fine-tune's copy with "
            "train.init_resize_vocab = true); or use template 'plain' with this tokenizer"
        )
    end = chat.end_of_turn
    if end is None and tokenizer.eos_id is None:
        raise LlmkitError(
            f"{where} ends turns with the tokenizer's EOS, but the tokenizer has no special "
            "token: add one to tokenizer.special_tokens or set data.source.end_of_turn"
        )
    if end is not None and tokenizer.token_to_id(end) is None:
        raise LlmkitError(
            f"data.source.end_of_turn {end!r} is not a token of the tokenizer; list it in "
            "data.source.special_tokens"
        )
    tokenizer.chat_template, tokenizer.end_of_turn = chat.template, end
    path = tokenizer.save_config(run_dir)
    log(f"data: chat template {chat.name} -> {path}")
    if template_has_unknown_text(tokenizer, chat.template):
        log(
            f"data: warning: the tokenizer has no token for some text of template {chat.name!r} "
            f"(it becomes {UNK}); a tokenizer trained on this data would have them"
        )


def template_has_unknown_text(tokenizer: Tokenizer, template: str) -> bool:
    """Whether the template's own text (a turn of each role, empty) holds characters a
    char tokenizer does not know."""
    from llmkit.data.chat import render
    from llmkit.messages import ROLES

    unk = tokenizer.token_to_id(UNK)
    if unk is None:
        return False
    turns = [{"role": role, "content": ""} for role in ROLES]
    try:
        text = render(
            template, turns, add_generation_prompt=True, tokens=tokenizer.template_tokens()
        )
    except ChatTemplateError:  # a template may refuse this made-up conversation
        return False
    return unk in tokenizer.encode(text)
