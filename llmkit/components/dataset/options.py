"""The options of the built-in corpus sources (torch-free, datasets-free: a spec is checked
without them), with the chat templates the ``chat`` source's options name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator

from llmkit.options import ComponentOptions


class FileSourceOptions(ComponentOptions):
    """Options shared by sources that read local files."""

    paths: list[str] = Field(
        default_factory=list,
        description="Files or glob patterns (** recurses); relative to the current directory. "
        "Required.",
    )
    val_paths: list[str] | None = Field(
        None, description="Explicit validation files or globs, instead of splitting `paths`."
    )


class TableSourceOptions(FileSourceOptions):
    """Options of sources with a text field, read by ``datasets.load_dataset``."""

    text_field: str = Field("text", min_length=1, description="The field holding the text.")
    val_fraction: float = Field(
        0.05, gt=0, lt=1, description="Share of documents held out (seeded) without val_paths."
    )
    cache_dir: str | None = Field(
        None, description="Where datasets keeps its Arrow copy; default datasets' own cache."
    )


class PythonStdlibOptions(ComponentOptions):
    """Options of the python-stdlib source."""

    include_tests: bool = Field(
        False, description="Include the test suites (test/, tests/, idle_test/ directories)."
    )
    val_fraction: float = Field(
        0.05, gt=0, lt=1, description="Share of files (by seeded hash of the path) to validate on."
    )
    max_files: int | None = Field(
        None, gt=0, description="Use at most this many files, picked in a seeded order."
    )
    max_bytes: int | None = Field(
        None, gt=0, description="Use at most this many bytes of source, picked in a seeded order."
    )


class TextOptions(FileSourceOptions):
    """Options of the text source."""

    val_fraction: float = Field(
        0.1, gt=0, lt=1, description="Share of the text (tail) or of the files held out."
    )
    split: Literal["tail", "file"] = Field(
        "tail",
        description="tail: the last val_fraction of each file's characters is validation "
        "(nanoGPT's shakespeare_char); file: whole files by seeded hash of the path.",
    )


class JsonlOptions(TableSourceOptions):
    """Options of the jsonl source."""


class ParquetOptions(TableSourceOptions):
    """Options of the parquet source."""


class SavedOptions(ComponentOptions):
    """Options of the saved source."""

    path: str = Field(
        "", description="Directory written by Dataset/DatasetDict.save_to_disk. Required."
    )
    text_field: str = Field("text", min_length=1, description="The column holding the text.")
    val_fraction: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="Share of train documents held out when no validation "
        "split (validation, valid, val or test) exists.",
    )


# -- chat --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatFormat:
    """How conversations become tokens: the Jinja2 ``template``, the ``special_tokens`` it
    needs in the tokenizer (added when the tokenizer is trained), the token that ends an
    assistant turn (None: the tokenizer's EOS), and whether only the assistant's tokens are
    trained on."""

    name: str
    template: str
    special_tokens: tuple[str, ...] = ()
    end_of_turn: str | None = None
    mask_prompt: bool = True


#: ``User:``/``Assistant:`` markers, each assistant turn ended by the tokenizer's EOS (the
#: spec's first special token): needs no new token, so it fits any base tokenizer.
PLAIN = ChatFormat(
    "plain",
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ 'System: ' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}",
)
#: ChatML (``<|im_start|>role\n...<|im_end|>\n``), as Qwen and others use it.
CHATML = ChatFormat(
    "chatml",
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    ("<|im_start|>", "<|im_end|>"),
    "<|im_end|>",
)
TEMPLATES = {f.name: f for f in (PLAIN, CHATML)}


def _is_jinja(template: str) -> bool:
    return "{{" in template or "{%" in template


class ChatOptions(FileSourceOptions):
    """Options of the chat source."""

    val_fraction: float = Field(
        0.05, gt=0, lt=1, description="Share of records held out (seeded) without val_paths."
    )
    template: str = Field(
        "plain",
        min_length=1,
        description="A built-in template (plain: User:/Assistant: markers, turns ended by "
        "the EOS; chatml: <|im_start|>/<|im_end|>) or a Jinja2 chat template as in Hugging "
        "Face's tokenizer_config.json.",
    )
    mask_prompt: bool = Field(
        True, description="Train only on the assistant's tokens (others get target -100)."
    )
    special_tokens: list[str] = Field(
        default_factory=list,
        description="More special tokens the template uses, added when the tokenizer is "
        "trained (a Jinja template's own tokens; the built-ins add theirs).",
    )
    end_of_turn: str | None = Field(
        None,
        min_length=1,
        description="The token ending an assistant turn, where generation stops; default "
        "the template's (plain: the EOS, chatml: <|im_end|>).",
    )

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        if _is_jinja(value):
            from jinja2 import TemplateSyntaxError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            try:
                ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(value)
            except TemplateSyntaxError as exc:
                raise ValueError(
                    f"Jinja syntax error at line {exc.lineno} of the template: {exc.message}"
                ) from None
        elif value not in TEMPLATES:
            raise ValueError(
                f"unknown template {value!r} (built-in: {', '.join(TEMPLATES)}; or give a "
                "Jinja2 chat template)"
            )
        return value

    @field_validator("special_tokens")
    @classmethod
    def _tokens(cls, tokens: list[str]) -> list[str]:
        if any(not t for t in tokens):
            raise ValueError("a special token cannot be empty")
        return tokens


class TokensOptions(ComponentOptions):
    """Options of the tokens source: a token store, or llm.c/nanoGPT ``.bin`` files."""

    path: str = Field(
        "", description="A token store written by `llmkit data prepare` (its directory)."
    )
    paths: list[str] = Field(
        default_factory=list,
        description="Instead of a store: llm.c .bin files or globs for training "
        "(e.g. fineweb_train_*.bin); tokenizer.path names their tokenizer.",
    )
    val_paths: list[str] | None = Field(
        None, description="With paths: the validation .bin files (e.g. fineweb_val_*.bin)."
    )
    header: bool = Field(
        True,
        description="With paths: the files have llm.c's 1024-byte header; false: bare ids "
        "(nanoGPT's train.bin/val.bin).",
    )
    dtype: Literal["uint16", "uint32"] = Field(
        "uint16", description="With paths and header = false: the ids' type."
    )
    verify: bool = Field(
        True,
        description="Check each shard when a process first reads it: a store's SHA-256, a "
        ".bin file's largest id against the tokenizer.",
    )
