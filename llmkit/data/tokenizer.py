"""Tokenizers: byte-level BPE or one token per character, both Hugging Face ``tokenizers``
objects saved as a single ``tokenizer.json``.

* :func:`train_bpe` — GPT-2-style byte-level BPE: every byte is in the initial alphabet, so
  any text (non-ASCII, emoji, tabs, leading spaces) round-trips exactly.
* :func:`train_char` — one id per character seen in the corpus, sorted, so the ids match
  nanoGPT's ``stoi`` (special tokens come after the characters; ``<unk>`` last).
* :func:`build_tokenizer` — what a run does: use a given file, reuse the run's file, or train.
* :meth:`Tokenizer.encode` and :meth:`Tokenizer.encode_batch` hand texts over
  :data:`~llmkit.data.long_text.CHUNK_CHARS` to :func:`~llmkit.data.long_text.encode_long`
  (bounded memory, in pieces).

A tokenizer may carry a chat template (:meth:`Tokenizer.apply_chat_template`), saved beside
``tokenizer.json`` as a Hugging Face ``tokenizer_config.json`` (``chat_template``; its
``eos_token`` is the token that ends an assistant turn, where generation stops).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from llmkit.data.long_text import BATCH_CHARS, CHUNK_CHARS, encode_long
from llmkit.errors import LlmkitError, first_line
from llmkit.files import read_json, write_text_atomic

if TYPE_CHECKING:
    import numpy as np
    import tokenizers

    from llmkit.spec import TokenizerSpec

Kind = Literal["bpe", "char", "pretrained"]
UNK = "<unk>"
#: The Hugging Face file beside tokenizer.json that holds the chat template.
CONFIG_FILE = "tokenizer_config.json"
#: The smallest byte-level BPE vocabulary: one token per byte.
N_BYTES = 256


class Tokenizer:
    """A thin wrapper over a ``tokenizers.Tokenizer`` with the few calls llmkit needs.

    ``encode`` never adds special tokens (no BOS/CLS post-processing) and ``decode`` keeps
    them by default, so ``decode(encode(x)) == x`` for any text the tokenizer can represent.

    ``chat_template`` (a Jinja2 string, as Hugging Face's) and ``end_of_turn`` (the token
    ending an assistant turn; default the EOS) are set for chat models; ``bos_token`` is
    what a template's ``bos_token`` renders as (a Hugging Face config's; default none).
    """

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        kind: Kind | None = None,
        eos_token: str | None = None,
        *,
        chat_template: str | None = None,
        end_of_turn: str | None = None,
        bos_token: str | None = None,
    ) -> None:
        self.tok = tok
        self.kind: Kind = kind or _infer_kind(tok)
        self._eos_token = eos_token
        self.chat_template = chat_template
        self.end_of_turn = end_of_turn
        self.bos_token = bos_token
        self._template_from: tuple[str, str] | None = None  # (template, the file it is from)

    # -- encoding ----------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; one longer than :data:`CHUNK_CHARS` in pieces
        (:func:`encode_long`), the same ids for llmkit's tokenizers."""
        if len(text) > CHUNK_CHARS:
            return encode_long(self, text).tolist()
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (in parallel, on the Rust side), at most
        :data:`BATCH_CHARS` characters per call; a text longer than :data:`CHUNK_CHARS` in
        pieces (:func:`encode_long`)."""
        out: list[list[int]] = [[] for _ in texts]
        group: list[int] = []
        size = 0
        for i, text in enumerate(texts):
            if len(text) > CHUNK_CHARS:
                out[i] = encode_long(self, text).tolist()
                continue
            if group and size + len(text) > BATCH_CHARS:
                self._encode_into(out, texts, group)
                group, size = [], 0
            group.append(i)
            size += len(text)
        self._encode_into(out, texts, group)
        return out

    def _encode_into(self, out: list[list[int]], texts: Sequence[str], which: list[int]) -> None:
        if not which:
            return
        fast = getattr(self.tok, "encode_batch_fast", None)  # no offsets: cheaper
        encs = (fast or self.tok.encode_batch)([texts[i] for i in which], add_special_tokens=False)
        for i, enc in zip(which, encs):
            out[i] = enc.ids

    def char_table(self) -> CharTable | None:
        """A char tokenizer's vocabulary as a lookup table (:class:`CharTable`); None for
        other kinds."""
        unk = self.unk_id
        if self.kind != "char" or unk is None:
            return None
        vocab = self.tok.get_vocab(with_added_tokens=True)
        return CharTable(vocab, unk, self.added_texts())

    def added_texts(self) -> list[str]:
        """The texts of the added (special) tokens, which the tokenizer matches first."""
        return [t.content for t in self.tok.get_added_tokens_decoder().values()]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- vocabulary --------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special tokens and their ids, in id order."""
        added = self.tok.get_added_tokens_decoder()
        return {t.content: i for i, t in sorted(added.items()) if t.special}

    @property
    def eos_id(self) -> int | None:
        """The document separator: ``eos_token`` if given and known, else the special token
        with the lowest id (the first of the spec's ``special_tokens``), else None."""
        if self._eos_token is not None:
            i = self.tok.token_to_id(self._eos_token)
            if i is not None:
                return i
        specials = self.special_tokens
        return next(iter(specials.values()), None)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    @property
    def unk_id(self) -> int | None:
        """The id text outside the vocabulary becomes (a char tokenizer's ``<unk>``); None
        when every text is representable (byte-level BPE)."""
        unk = getattr(self.tok.model, "unk_token", None)
        return self.tok.token_to_id(unk) if isinstance(unk, str) else None

    def count_unknown(self, ids: Iterable[int]) -> int:
        """How many of ``ids`` are the unknown token: for a char tokenizer, the characters
        of the encoded text that are not in its vocabulary."""
        unk = self.unk_id
        if unk is None:
            return 0
        if hasattr(ids, "dtype"):  # an array (encode_long): no Python loop over it
            import numpy as np

            return int(np.count_nonzero(np.asarray(ids) == unk))
        return sum(1 for i in ids if int(i) == unk)

    def unknown_note(self, ids: Iterable[int], where: str) -> str | None:
        """A one-line note saying how much of the text encoded as ``ids`` (described by
        ``where``) was outside the vocabulary; None when all of it was known."""
        n = self.count_unknown(ids)
        if not n:
            return None
        what = "character" if self.kind == "char" else "piece"
        return (
            f"{n:,} {what}{'s' if n != 1 else ''} of {where} {'are' if n != 1 else 'is'} "
            f"not in the tokenizer's vocabulary and became {self.tok.id_to_token(self.unk_id)}"
        )

    @property
    def eos_token(self) -> str | None:
        """The text of the EOS token, if there is one."""
        i = self.eos_id
        return None if i is None else self.tok.id_to_token(i)

    # -- chat --------------------------------------------------------------------------

    @property
    def end_of_turn_id(self) -> int | None:
        """The id ending an assistant turn: ``end_of_turn``'s, else the EOS."""
        if self.end_of_turn is not None:
            return self.tok.token_to_id(self.end_of_turn)
        return self.eos_id

    @property
    def stop_ids(self) -> list[int]:
        """The ids a chat reply stops at: the end of turn and the EOS."""
        return sorted({i for i in (self.end_of_turn_id, self.eos_id) if i is not None})

    @property
    def template_source(self) -> str:
        """Where the chat template came from, for errors: its ``tokenizer_config.json``
        while it is the template read from there."""
        if self._template_from is not None and self._template_from[0] == self.chat_template:
            return self._template_from[1]
        return "chat template"

    def template_tokens(self) -> dict[str, str | None]:
        """The special-token variables a chat template is rendered with: ``eos_token`` is
        the end of turn (as in Hugging Face configs), ``pad_token`` the EOS."""
        return {
            "eos_token": self.end_of_turn or self.eos_token,
            "pad_token": self.eos_token,
            "bos_token": self.bos_token,
        }

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
    ) -> list[int] | str:
        """``messages`` (``{"role", "content"}`` dicts) rendered with the chat template,
        followed by the assistant's generation prompt: the ids (``tokenize``) or the
        text. A one-line error when the tokenizer has no template."""
        from llmkit.data.chat import render
        from llmkit.messages import check_messages

        if not self.chat_template:
            raise LlmkitError(
                "the tokenizer has no chat template (train on a chat dataset, "
                "data.source.name = 'chat', or add one to tokenizer_config.json)"
            )
        text = render(
            self.chat_template,
            check_messages(messages),
            add_generation_prompt=add_generation_prompt,
            tokens=self.template_tokens(),
            source=self.template_source,
        )
        return self.encode(text) if tokenize else text

    def config(self) -> dict[str, Any]:
        """The Hugging Face ``tokenizer_config.json`` content for the chat template."""
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": self.chat_template,
            "eos_token": self.end_of_turn or self.eos_token,
            "pad_token": self.eos_token,
            "bos_token": self.bos_token,
            "clean_up_tokenization_spaces": False,
        }

    def save_config(self, directory: str | Path) -> Path | None:
        """Write ``tokenizer_config.json`` into ``directory`` when there is a chat template
        (atomically; unchanged content is not rewritten); its path, or None."""
        if not self.chat_template:
            return None
        path = Path(directory) / CONFIG_FILE
        text = json.dumps(self.config(), indent=2, ensure_ascii=False) + "\n"
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            return path
        _write_atomic(path, text)
        return path

    # -- files -------------------------------------------------------------------------

    def to_str(self) -> str:
        """The tokenizer.json content."""
        return self.tok.to_str()

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json atomically (a temp file, then a rename), and the chat
        template's ``tokenizer_config.json`` beside it if there is one."""
        path = Path(path)
        _write_atomic(path, self.to_str())
        self.save_config(path.parent)

    @classmethod
    def from_str(cls, content: str, kind: Kind | None = None) -> Tokenizer:
        """A tokenizer from tokenizer.json content (:meth:`to_str`)."""
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(content), kind)

    @classmethod
    def load(
        cls, path: str | Path, kind: Kind | None = None, eos_token: str | None = None
    ) -> Tokenizer:
        """Read a tokenizer.json (or a directory holding one)."""
        from tokenizers import Tokenizer as HFTokenizer

        p = Path(path).expanduser()
        if p.is_dir() and (p / "tokenizer.json").is_file():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise LlmkitError(f"tokenizer file not found: {p}")
        try:
            tok = HFTokenizer.from_file(str(p))
        except Exception as exc:
            raise LlmkitError(f"{p}: not a valid tokenizer.json ({first_line(exc)})") from exc
        config = p.parent / CONFIG_FILE
        template, end, bos = read_config(config)
        out = cls(tok, kind, eos_token, chat_template=template, end_of_turn=end, bos_token=bos)
        if template:
            out._template_from = (template, f"{config}: chat_template")
        return out

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A JSON file's object, None when there is no file; a one-line error naming the file
    when it is not JSON or not an object."""
    if not path.is_file():
        return None
    data = read_json(path)  # one line for bad, deeply nested or non-UTF-8 JSON
    if not isinstance(data, dict):
        raise LlmkitError(f"{path}: expected a JSON object")
    return data


def read_config(path: Path) -> tuple[str | None, str | None, str | None]:
    """The chat template, the end-of-turn token (its ``eos_token``) and the ``bos_token``
    of a Hugging Face ``tokenizer_config.json``; all None when there is no file."""
    data = read_json_object(path)
    if data is None:
        return None, None, None
    template = data.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if template is not None and not isinstance(template, str):
        raise LlmkitError(f"{path}: chat_template must be a string")
    eos, bos = (_token_text(data.get(name)) for name in ("eos_token", "bos_token"))
    return template or None, eos, bos


def _token_text(value: Any) -> str | None:
    """A config's token: a string, or a serialized AddedToken's ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class CharTable:
    """A char tokenizer's vocabulary indexed by code point: encodes a whole text with one
    array lookup, hundreds of times faster than the tokenizer's regex split, and equal to
    it (tests/data/test_tokenizer.py). ``encode`` returns None for a text it cannot do
    alone: one holding a special token's text (the tokenizer matches those first) or one
    that is not valid Unicode."""

    def __init__(self, vocab: dict[str, int], unk_id: int, specials: Sequence[str]) -> None:
        import numpy as np

        singles = {c: i for c, i in vocab.items() if len(c) == 1}
        self.table = np.full(max(map(ord, singles), default=0) + 1, unk_id, dtype=np.int32)
        for c, i in singles.items():
            self.table[ord(c)] = i
        self.unk_id = unk_id
        self.specials = [t for t in specials if len(t) > 1]

    def encode(self, text: str) -> np.ndarray | None:
        """The ids of ``text`` (int32), or None (see the class docstring)."""
        import numpy as np

        if any(s in text for s in self.specials):
            return None
        try:
            points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        except UnicodeEncodeError:  # a lone surrogate
            return None
        last = len(self.table) - 1
        ids = self.table[np.minimum(points, last)]
        ids[points > last] = self.unk_id
        return ids


# -- long texts -----------------------------------------------------------------------------


def _infer_kind(tok: tokenizers.Tokenizer) -> Kind:
    data = json.loads(tok.to_str())
    model = (data.get("model") or {}).get("type")
    decoder = (data.get("decoder") or {}).get("type")
    if model == "WordLevel" and decoder == "Fuse":
        return "char"
    if model == "BPE" and decoder == "ByteLevel":
        return "bpe"
    return "pretrained"


# -- training -------------------------------------------------------------------------------


def on_terminal() -> bool:
    """Whether stderr, where progress bars draw, is a terminal: off one (a pipe, a log
    file) llmkit asks its libraries for no progress bars."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str] = ("<|endoftext|>",),
    min_frequency: int = 2,
    *,
    show_progress: bool | None = None,
) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenization, no prefix space).

    Special tokens get ids ``0..len(special_tokens)-1``; the vocabulary holds at most
    ``vocab_size`` ids (fewer if the corpus runs out of pairs to merge). ``tokenizers``'
    progress bars show when ``show_progress`` (default: stderr is a terminal).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = _dedupe(special_tokens)
    check_bpe_vocab(vocab_size, specials)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=on_terminal() if show_progress is None else show_progress,
    )
    tok.train_from_iterator(_nonempty(texts), trainer=trainer)
    return Tokenizer(tok, "bpe", specials[0] if specials else None)


def check_bpe_vocab(vocab_size: int, special_tokens: Sequence[str], where: str = "") -> None:
    """Refuse a byte-level BPE vocabulary without room for every byte and special token, in
    one line naming ``where`` (the spec file and key, ``tokenizer.vocab_size`` by default)
    and the minimum."""
    specials = _dedupe(special_tokens)
    least = N_BYTES + len(specials)
    if vocab_size >= least:
        return
    names = ", ".join(specials) if len(specials) <= 6 else f"{', '.join(specials[:6])}, …"
    raise LlmkitError(
        f"{where or 'tokenizer.vocab_size'}: {vocab_size} is too small for byte-level BPE: it "
        f"needs at least {least} ({N_BYTES} bytes + {len(specials)} special tokens"
        f"{': ' + names if specials else ''})"
    )


def train_char(
    texts: Iterable[str], special_tokens: Sequence[str] = ("<|endoftext|>",)
) -> Tokenizer:
    """One token per distinct character, ids in sorted character order; then the special
    tokens; then ``<unk>``, which unknown characters map to."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    chars: set[str] = set()
    for text in texts:
        chars.update(text)
    if not chars:
        raise LlmkitError("cannot train a char tokenizer: the corpus has no text")
    specials = [t for t in _dedupe(special_tokens) if t not in chars]
    vocab = {c: i for i, c in enumerate(sorted(chars))}
    for t in [*specials, UNK]:
        vocab.setdefault(t, len(vocab))
    tok = HFTokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if specials:
        tok.add_special_tokens(specials)
    return Tokenizer(tok, "char", specials[0] if specials else None)


def build_tokenizer(
    spec: TokenizerSpec,
    texts: Callable[[], Iterable[str]],
    out_path: str | Path,
    default_vocab: int,
    *,
    log: Callable[[str], None] | None = None,
    source: str | None = None,
) -> Tokenizer:
    """The run's tokenizer: ``spec.path`` if given (copied to ``out_path``); else
    ``out_path`` if it exists (a resumed run); else trained on at most ``spec.train_bytes``
    of ``texts()`` and saved to ``out_path``. A BPE vocabulary too small to train is refused
    before any text is read, naming ``source`` (the spec file) and the key it came from."""
    say = log or (lambda _msg: None)
    eos = spec.special_tokens[0] if spec.special_tokens else None
    if spec.path:
        tok = Tokenizer.load(spec.path, "pretrained", eos)
        say(f"tokenizer: {spec.path} ({tok.vocab_size} tokens)")
        if not Path(out_path).exists():
            tok.save(out_path)  # a copy, so the run directory is self-contained
        return tok
    out = Path(out_path)
    if out.exists():
        tok = Tokenizer.load(out, None, eos)
        if tok.kind != spec.kind:
            raise LlmkitError(
                f"{out} holds a {tok.kind} tokenizer but tokenizer.kind is {spec.kind!r}; "
                "use a new run directory or delete the file"
            )
        say(f"tokenizer: reusing {out} ({tok.vocab_size} tokens)")
        return tok
    vocab = spec.vocab_size or default_vocab
    if spec.kind != "char":
        key = "tokenizer.vocab_size" if spec.vocab_size else "model.vocab_size"
        check_bpe_vocab(vocab, spec.special_tokens, f"{source}: {key}" if source else key)
    sample = take_bytes(texts(), spec.train_bytes)
    if spec.kind == "char":
        tok = train_char(sample, spec.special_tokens)
    else:
        tok = train_bpe(sample, vocab, spec.special_tokens, spec.min_frequency)
    tok.save(out)
    say(f"tokenizer: trained {tok.kind}, {tok.vocab_size} tokens -> {out}")
    return tok


def take_bytes(texts: Iterable[str], limit: int | None) -> Iterator[str]:
    """``texts`` up to ``limit`` UTF-8 bytes in all (the last one cut short), or all."""
    if limit is None:
        yield from texts
        return
    left = limit
    for text in texts:
        n = len(text.encode("utf-8"))
        if n >= left:
            yield text.encode("utf-8")[:left].decode("utf-8", errors="ignore")
            return
        left -= n
        yield text


def _dedupe(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        if text:
            yield text
