"""``llmkit data prepare``'s work: a token store from a spec's ``data.source`` and
``tokenizer`` (trained as a run would train it, when the spec names none), or from text
files with a given tokenizer (:func:`prepare_files`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmkit.data.shards import SHARD_TOKENS, TOKENIZER, text_sha256
from llmkit.data.shards_write import Progress, SplitInput, open_for_writing, write_store
from llmkit.errors import LlmkitError

if TYPE_CHECKING:
    from llmkit.spec import ResolvedSpec, TokenizerSpec

#: A file's extension -> the dataset source that reads it.
SOURCES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "text"}


def prepare_spec(
    rs: ResolvedSpec,
    out: str | Path,
    *,
    workers: int = 1,
    shard_tokens: int = SHARD_TOKENS,
    layout: str = "llmkit",
    progress: Callable[[Progress], None] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The store ``out`` of the spec's source, tokenized with its tokenizer
    (``tokenizer.path``, else trained on the training split as a run trains it)."""
    if rs.dataset is None:
        raise LlmkitError("no dataset source: the registry has no 'dataset' kind")
    spec = rs.spec
    seed = spec.train.seed if spec.data.seed is None else spec.data.seed
    source = rs.dataset.build(rs.dataset.options)
    return prepare_source(
        source,
        rs.dataset.to_dict(),
        seed,
        spec.tokenizer,
        spec.model.vocab_size,
        out,
        workers=workers,
        shard_tokens=shard_tokens,
        layout=layout,
        progress=progress,
        log=log,
    )


def file_source(
    paths: Sequence[str],
    *,
    val_paths: Sequence[str] | None = None,
    text_field: str | None = None,
    val_fraction: float | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The dataset source reading ``paths`` (``.jsonl``/``.json``, ``.parquet`` or
    ``.txt``, one kind), built through the registry, and its options as a spec writes them."""
    from llmkit.registry import get_registry

    kinds = {SOURCES.get(Path(p).suffix.lower()) for p in [*paths, *(val_paths or [])]}
    if None in kinds or len(kinds) != 1:
        raise LlmkitError(
            "data prepare: give files of one kind: .jsonl/.json, .parquet or .txt (or a spec)"
        )
    name = kinds.pop()
    assert name is not None
    options: dict[str, Any] = {"paths": list(paths)}
    if val_paths:
        options["val_paths"] = list(val_paths)
    if val_fraction is not None:
        options["val_fraction"] = val_fraction
    if text_field is not None:
        if name == "text":
            raise LlmkitError("--text-field is for .jsonl and .parquet files")
        options["text_field"] = text_field
    record = get_registry().get("dataset", name)
    try:
        parsed = record.parse_options(options)
    except Exception as exc:  # pydantic's ValidationError
        from llmkit.errors import first_line

        raise LlmkitError(f"data prepare: {first_line(exc)}") from exc
    return record.load()(parsed), {"name": name, **parsed.model_dump(mode="json")}


def prepare_files(
    paths: Sequence[str],
    out: str | Path,
    *,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    val_paths: Sequence[str] | None = None,
    text_field: str | None = None,
    val_fraction: float | None = None,
    seed: int = 0,
    workers: int = 1,
    shard_tokens: int = SHARD_TOKENS,
    layout: str = "llmkit",
    progress: Callable[[Progress], None] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The store ``out`` of text files: ``tokenizer`` (a tokenizer.json), or a byte-level
    BPE of ``vocab_size`` trained on them."""
    from llmkit.spec import TokenizerSpec

    if tokenizer is None and vocab_size is None:
        raise LlmkitError("data prepare: give --tokenizer tokenizer.json (or --vocab-size N)")
    source, options = file_source(
        paths, val_paths=val_paths, text_field=text_field, val_fraction=val_fraction
    )
    tok_spec = TokenizerSpec(path=tokenizer, vocab_size=vocab_size)
    return prepare_source(
        source,
        options,
        seed,
        tok_spec,
        vocab_size or 0,
        out,
        workers=workers,
        shard_tokens=shard_tokens,
        layout=layout,
        progress=progress,
        log=log,
    )


def prepare_source(
    source: Any,
    options: dict[str, Any],
    seed: int,
    tok_spec: TokenizerSpec,
    default_vocab: int,
    out: str | Path,
    *,
    workers: int,
    shard_tokens: int,
    layout: str,
    progress: Callable[[Progress], None] | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """A store from a built dataset source: its splits (loaded only when needed), its
    tokenizer, then :func:`~llmkit.data.shards_write.write_store`."""
    from llmkit.data.prepare import SPLITS, _check_splits, iter_texts, library_progress_bars
    from llmkit.data.tokenizer import Tokenizer, build_tokenizer

    out = Path(out).expanduser()
    chat = getattr(source, "chat_format", None)
    if callable(chat) and chat() is not None:
        raise LlmkitError("data prepare: chat sources (loss masks) are not written to stores yet")
    fingerprint = getattr(source, "fingerprint", None)
    files = fingerprint() if callable(fingerprint) else ""
    tok_recipe: dict[str, Any] = tok_spec.model_dump(mode="json")
    if tok_spec.path:  # a file: named by its content
        tok_recipe["path"] = text_sha256(Tokenizer.load(tok_spec.path).to_str())
    else:
        tok_recipe["vocab_size"] = tok_spec.vocab_size or default_vocab
    recipe = {
        "source": {"options": options, "seed": seed, "files": files},
        "tokenizer": tok_recipe,
    }
    open_for_writing(out, recipe, layout, shard_tokens)  # a clash is refused before any work
    loaded: dict[str, Any] = {}

    def splits() -> Any:
        if not loaded:
            parts = source.splits(seed)
            _check_splits(parts, options.get("name", "data.source"))
            loaded["parts"] = parts
            log(f"data prepare: {source.describe()}")
        return loaded["parts"]

    def train_texts() -> Iterator[str]:
        return iter_texts(splits()["train"], seed)

    inputs = {
        split: SplitInput(
            lambda split=split: iter_texts(splits()[split]),
            lambda split=split: len(splits()[split]),
        )
        for split in SPLITS
    }
    with library_progress_bars():  # datasets' bars (loading the corpus): on a terminal only
        tokenizer = build_tokenizer(tok_spec, train_texts, out / TOKENIZER, default_vocab, log=log)
        return write_store(
            inputs,
            tokenizer,
            out,
            recipe=recipe,
            description=lambda: str(source.describe()),
            workers=workers,
            shard_tokens=shard_tokens,
            layout=layout,
            progress=progress,
            log=log,
        )
