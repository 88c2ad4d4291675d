"""Chat templates: Jinja2 strings rendered as Hugging Face's ``apply_chat_template`` renders
them (a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, the variables
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``pad_token`` and
``unk_token``, and ``raise_exception``), and conversations cut into prompt and response
text.

Which text is the assistant's is found by rendering prefixes of the conversation: the
response of turn ``i`` is what ``messages[:i+1]`` adds to ``messages[:i]`` rendered with the
generation prompt. That is exactly what a model sees at generation time (the prompt
rendered and tokenized alone, the reply generated after it), and it works for any template
whose renderings of a conversation's prefixes are prefixes of each other.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from llmkit.errors import LlmkitError

#: The special-token variables a template may use, as Hugging Face passes them.
TOKEN_VARIABLES = ("bos_token", "eos_token", "pad_token", "unk_token")

Message = Mapping[str, str]


class ChatTemplateError(LlmkitError):
    """A template that does not compile or render, or a conversation it cannot cut."""


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """The compiled template (cached per source); a syntax error names its line."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template: Jinja syntax error at line {exc.lineno}: {exc.message}"
        ) from exc


def render(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    tokens: Mapping[str, str | None] | None = None,
) -> str:
    """``messages`` rendered with ``template``; ``tokens`` fills the special-token
    variables (absent ones render as empty strings)."""
    from jinja2.exceptions import TemplateError

    values = {name: (tokens or {}).get(name) or "" for name in TOKEN_VARIABLES}
    try:
        return compile_template(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **values,
        )
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template: {exc.message or type(exc).__name__}") from exc
    except Exception as exc:  # a template may fail in any way (types, arithmetic…)
        raise ChatTemplateError(f"chat template: {type(exc).__name__}: {exc}") from exc


def segments(
    template: str,
    messages: Sequence[Message],
    *,
    tokens: Mapping[str, str | None] | None = None,
    mask_prompt: bool = True,
) -> list[tuple[str, bool]]:
    """The conversation's text in order as ``(text, trained)`` pieces: with
    ``mask_prompt`` the assistant turns (content and the template's end-of-turn text) are
    trained and everything else is not; without it, the whole text is trained."""
    whole = render(template, messages, tokens=tokens)
    if not mask_prompt:
        return [(whole, True)] if whole else []
    out: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(template, messages[:i], add_generation_prompt=True, tokens=tokens)
        turn = render(template, messages[: i + 1], tokens=tokens)
        if not (prompt.startswith(done) and turn.startswith(prompt)):
            raise ChatTemplateError(
                f"chat template: the rendering of messages[:{i + 1}] does not extend that of "
                f"messages[:{i}] with the generation prompt, so the assistant's text of "
                f"messages[{i}] cannot be found; use a template whose turns only append text"
            )
        out += [(prompt[len(done) :], False), (turn[len(prompt) :], True)]
        done = turn
    if not whole.startswith(done):
        raise ChatTemplateError(
            "chat template: the whole conversation does not extend its last assistant turn"
        )
    out.append((whole[len(done) :], False))
    return [(text, trained) for text, trained in out if text]


class ChatEncoder:
    """The ``datasets.map`` function of chat data: for each conversation (JSON messages),
    its ids, a 0/1 mask of the ids trained on, and its rendered text's UTF-8 bytes. Holds
    the tokenizer as JSON so it pickles cheaply into worker processes."""

    def __init__(
        self,
        tokenizer_json: str,
        template: str,
        tokens: Mapping[str, str | None],
        mask_prompt: bool,
    ) -> None:
        self.tokenizer_json = tokenizer_json
        self.template = template
        self.tokens = dict(tokens)
        self.mask_prompt = mask_prompt
        self._tok: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}

    def __call__(self, messages: list[str], where: list[str]) -> dict[str, list[Any]]:
        if self._tok is None:
            from tokenizers import Tokenizer as HFTokenizer

            self._tok = HFTokenizer.from_str(self.tokenizer_json)
        pieces: list[list[tuple[str, bool]]] = []
        for conv, at in zip(messages, where):
            try:
                pieces.append(
                    segments(
                        self.template,
                        json.loads(conv),
                        tokens=self.tokens,
                        mask_prompt=self.mask_prompt,
                    )
                )
            except ChatTemplateError as exc:
                raise ChatTemplateError(f"{at}: {exc}") from None
        flat = [text for conv in pieces for text, _ in conv]
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encs = iter(encode(flat, add_special_tokens=False) if flat else [])
        ids, mask, n_bytes = [], [], []
        for conv in pieces:
            row_ids: list[int] = []
            row_mask: list[int] = []
            for _text, trained in conv:
                piece = next(encs).ids
                row_ids += piece
                row_mask += [int(trained)] * len(piece)
            ids.append(row_ids)
            mask.append(row_mask)
            n_bytes.append(sum(len(text.encode("utf-8")) for text, _ in conv))
        return {"ids": ids, "mask": mask, "n_bytes": n_bytes}
