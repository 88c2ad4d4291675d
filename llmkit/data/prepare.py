"""From a corpus source to token files: build the source, train (or load) the tokenizer,
tokenize each split once with ``datasets.map`` and stream the ids into a token file whose
name hashes the source, its input files, the seed and the tokenizer.

A source with a ``chat_format()`` (chat data, :mod:`llmkit.data.chat`) gives conversations
instead of plain text: its template's special tokens join the tokenizer's, the tokenizer
carries the template into the run (``tokenizer_config.json``), and each split is written
with a loss mask and document offsets beside the ids."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmkit.data.chat import ChatEncoder
from llmkit.data.chat_prepare import attach_template, iter_chat_texts, with_template_tokens
from llmkit.data.mixture import DataPart, prepare_mixture
from llmkit.data.samplers import padded_examples, trainable_blocks
from llmkit.data.store import DataStore, recipe_key
from llmkit.data.tokenizer import Tokenizer, build_tokenizer, on_terminal
from llmkit.data.tokens import (
    FORMAT_VERSION,
    TokenFile,
    _reusable,
    raise_if_full,
    token_dtype,
    write_masked_token_file,
    write_token_file,
)
from llmkit.errors import LlmkitError

if TYPE_CHECKING:
    import datasets

    from llmkit.spec import ResolvedSpec, TokenizerSpec

SPLITS = ("train", "validation")
_MAP_BATCH = 256  # documents per tokenization batch
_WRITE_BATCH = 4096  # documents per write to the token file


@dataclass
class PreparedData:
    """What training needs from the data side."""

    tokenizer: Tokenizer
    train: TokenFile | None
    validation: TokenFile
    source_description: str
    cache_dir: Path | None = None
    key: str = ""
    #: ``data.streaming``: the streamed source's files and settings
    #: (:func:`~llmkit.data.stream_prepare.stream_inputs`); ``train`` is then None.
    stream: dict[str, Any] | None = None
    #: ``data.mixture``'s sources, each prepared on its own (``train``/``validation`` are
    #: then the first one's); empty for a single source.
    parts: list[DataPart] = field(default_factory=list)


@contextmanager
def library_progress_bars(enabled: bool | None = None) -> Iterator[None]:
    """Within it, the progress bars of ``datasets`` and ``huggingface_hub`` are shown only
    when ``enabled`` (default: stderr is a terminal): off a terminal their carriage-return
    redraws ("tokenizing train:  40%|...") would fill a log. What it turned off is turned
    back on when it ends; it never turns bars on."""
    if on_terminal() if enabled is None else enabled:
        yield
        return
    import datasets.config
    import datasets.utils as ds_bars
    import huggingface_hub.constants as hub_config
    import huggingface_hub.utils as hub_bars

    undo: list[Callable[[], None]] = []
    # HF_DATASETS_DISABLE_PROGRESS_BARS=0 (HF_HUB_...=0) asks for the bars everywhere
    forced_on = datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is False
    if not forced_on and not ds_bars.are_progress_bars_disabled():
        ds_bars.disable_progress_bars()
        undo.append(ds_bars.enable_progress_bars)
    forced_on = hub_config.HF_HUB_DISABLE_PROGRESS_BARS is False
    if not forced_on and not hub_bars.are_progress_bars_disabled():
        hub_bars.disable_progress_bars()
        undo.append(hub_bars.enable_progress_bars)
    try:
        yield
    finally:
        for restore in reversed(undo):
            restore()


def prepare_data(
    rs: ResolvedSpec,
    run_dir: str | Path,
    tokenizer: Tokenizer | None = None,
    *,
    log: Callable[[str], None] = print,
) -> PreparedData:
    """Build the source, build/load the tokenizer (``run_dir/tokenizer.json``) and tokenize
    each split into a cached token file, reusing files made before: the run's own, or with
    ``data.shared_cache`` those an earlier run kept in the shared store
    (:mod:`llmkit.data.store`). The corpus is only loaded (``source.splits``) when something
    has to be made from it.

    Progress bars of the libraries it calls (``datasets``' loading and tokenizing) show on
    a terminal only (:func:`library_progress_bars`)."""
    with library_progress_bars():
        if rs.mixture:
            return _prepare_mixture(rs, Path(run_dir), tokenizer, log)
        return _prepare_data(rs, Path(run_dir), tokenizer, log)


def _prepare_mixture(
    rs: ResolvedSpec, run_dir: Path, tokenizer: Tokenizer | None, log: Callable[[str], None]
) -> PreparedData:
    """``data.mixture``: every source prepared as a spec of its own, one tokenizer for all."""
    tokenizer, parts = prepare_mixture(rs, run_dir, tokenizer, log, _prepare_data_logged)
    first = parts[0]
    description = "mixture: " + "; ".join(f"{p.name} ({p.description})" for p in parts)
    key = hashlib.sha256(
        json.dumps([[p.name, str(p.validation.path)] for p in parts]).encode()
    ).hexdigest()[:12]
    return PreparedData(
        tokenizer,
        first.train,
        first.validation,
        description,
        first.validation.path.parent,
        key,
        parts=parts,
    )


def _prepare_data_logged(
    rs: ResolvedSpec, run_dir: Path, tokenizer: Tokenizer, *, log: Callable[[str], None]
) -> PreparedData:
    return _prepare_data(rs, run_dir, tokenizer, log)


def _prepare_data(
    rs: ResolvedSpec, run_dir: Path, tokenizer: Tokenizer | None, log: Callable[[str], None]
) -> PreparedData:
    if rs.dataset is None:
        raise LlmkitError("no dataset source: the registry has no 'dataset' kind")
    spec = rs.spec
    seed = spec.train.seed if spec.data.seed is None else spec.data.seed
    source_options = rs.dataset.to_dict()
    source = rs.dataset.build(rs.dataset.options)
    if callable(getattr(source, "token_source", None)):  # ids already: a store, .bin files
        from llmkit.data.shards_open import prepare_tokens

        return prepare_tokens(rs, source, run_dir, tokenizer, log)
    if spec.data.streaming:  # read while training: only the tokenizer and validation now
        from llmkit.data.stream_prepare import prepare_stream

        cache = Path(spec.data.cache_dir).expanduser() if spec.data.cache_dir else run_dir / "data"
        cache.mkdir(parents=True, exist_ok=True)
        tokenizer, val, inputs, what = prepare_stream(rs, source, run_dir, tokenizer, cache, log)
        return PreparedData(tokenizer, None, val, what, cache, str(val.meta.get("key")), inputs)
    chat_format = getattr(source, "chat_format", None)
    chat = chat_format() if callable(chat_format) else None
    splits = _LazySplits(source, seed, rs.dataset.name, chat is not None, log)
    fingerprint = getattr(source, "fingerprint", None)
    files = fingerprint() if callable(fingerprint) else None
    # Only a source that can tell when its files change may share across runs.
    store = DataStore() if spec.data.shared_cache and files is not None else None

    tok_spec = spec.tokenizer if chat is None else with_template_tokens(spec.tokenizer, chat)
    if tokenizer is None:
        tokenizer = _tokenizer(
            rs, source_options, tok_spec, chat, splits, store, files or "", run_dir, log
        )
    if chat is not None:
        grow = spec.train.init_resize_vocab  # a fine-tune that may grow its vocabulary
        attach_template(tokenizer, chat, run_dir, log, add_tokens=grow)
    elif tokenizer.eos_id is None:
        log("data: the tokenizer has no special token; documents are joined without separator")

    key = data_key(source_options, seed, files or "", tokenizer)
    cache_dir = Path(spec.data.cache_dir).expanduser() if spec.data.cache_dir else run_dir / "data"
    cache_dir.mkdir(parents=True, exist_ok=True)
    paths = {split: cache_dir / f"{split}-{key}.bin" for split in SPLITS}
    found: dict[str, str] = {}  # split -> where its existing token file came from
    for split, path in paths.items():
        if _reusable(path):
            found[split] = f"cached {path.name}"
        elif store is not None and store.fetch_tokens(path.name, cache_dir):
            found[split] = f"shared cache {store.root}"
    tfs: dict[str, TokenFile] = {split: TokenFile(paths[split]) for split in found}
    if len(found) < len(SPLITS):
        splits.get()  # the corpus is needed (its summary is logged)
    elif not splits.loaded:  # nothing made from the corpus: its summary as it was then
        log(f"data: {tfs['train'].meta.get('source') or source.describe()}")
    for split, path in paths.items():
        if split in found:
            log(f"data: {split}: {len(tfs[split]):,} tokens ({found[split]})")
            continue
        meta = {"key": key, "source": splits.description()}
        tokenize = tokenize_split if chat is None else _chat_tokenizer(chat)
        tf = tokenize(splits.get()[split], tokenizer, path, num_proc=spec.data.num_proc, meta=meta)
        tfs[split] = tf
        log(f"data: {split}: {len(tf):,} tokens from {tf.n_bytes_text:,} bytes -> {path}")
        if store is not None:
            _keep(log, store.keep_tokens, path)
    description = tfs["train"].meta.get("source") or source.describe()
    if len(tfs["train"]) == 0:
        raise LlmkitError(f"data.source: {description}: the training split has no text")
    block_size = spec.data.block_size or rs.model.max_seq_len
    for tf in tfs.values():
        tf.layout = "padded" if spec.data.sampling == "padded" else "packed"
    if tfs["train"].has_mask or spec.data.sampling == "padded":
        for split, tf in tfs.items():
            _describe_rows(tf, split, block_size, log)
    return PreparedData(tokenizer, tfs["train"], tfs["validation"], description, cache_dir, key)


class _LazySplits:
    """The source's splits, loaded (and checked) on first use; the summary logged then."""

    def __init__(
        self, source: Any, seed: int, name: str, chat: bool, log: Callable[[str], None]
    ) -> None:
        self.source, self.seed, self.name, self.chat, self.log = source, seed, name, chat, log
        self._splits: Any = None

    @property
    def loaded(self) -> bool:
        return self._splits is not None

    def get(self) -> Any:
        if self._splits is None:
            splits = self.source.splits(self.seed)
            _check_splits(splits, self.name, self.chat)
            self._splits = splits
            self.log(f"data: {self.source.describe()}")
        return self._splits

    def description(self) -> str:
        self.get()
        return str(self.source.describe())


def _tokenizer(
    rs: ResolvedSpec,
    source_options: dict[str, Any],
    tok_spec: TokenizerSpec,
    chat: Any,
    splits: _LazySplits,
    store: DataStore | None,
    files: str,
    run_dir: Path,
    log: Callable[[str], None],
) -> Tokenizer:
    """The run's tokenizer (:func:`build_tokenizer`), taken from the shared store when an
    earlier run trained it for the same recipe, and kept there when trained here."""
    spec = rs.spec
    seed = splits.seed
    out = run_dir / "tokenizer.json"

    def texts() -> Iterable[str]:
        if chat is None:
            return iter_texts(splits.get()["train"], seed)
        return iter_chat_texts(splits.get()["train"], seed, chat, tok_spec)

    if store is None or tok_spec.path or out.exists():  # nothing to train: nothing to share
        return build_tokenizer(
            tok_spec, texts, out, spec.model.vocab_size, log=log, source=rs.source
        )
    tok_dict = tok_spec.model_dump(mode="json")
    recipe = recipe_key(source_options, seed, files, tok_dict, spec.model.vocab_size)
    kept = store.tokenizer(recipe)
    if kept is not None:  # build_tokenizer then loads it
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(kept, out)
    tokenizer = build_tokenizer(
        tok_spec,
        texts,
        out,
        spec.model.vocab_size,
        log=log if kept is None else None,
        source=rs.source,
    )
    if kept is None:
        _keep(log, store.keep_tokenizer, recipe, out)
    else:
        what = f"{tokenizer.kind}, {tokenizer.vocab_size} tokens"
        log(f"tokenizer: {what}, trained by an earlier run")
    return tokenizer


def _keep(log: Callable[[str], None], put: Callable[..., None], *args: Any) -> None:
    """``put(*args)`` into the shared store; a failure there only loses the reuse."""
    try:
        put(*args)
    except OSError as exc:
        log(f"data: not kept in the shared cache ({exc})")


def _chat_tokenizer(chat: Any) -> Callable[..., TokenFile]:
    def tokenize(ds: Any, tokenizer: Tokenizer, path: Path, **kw: Any) -> TokenFile:
        return tokenize_chat_split(ds, tokenizer, chat, path, **kw)

    return tokenize


def _describe_rows(tf: TokenFile, split: str, block_size: int, log: Callable[[str], None]) -> None:
    """Log what a split gives under its layout; an error when it gives no trained row."""
    from llmkit.data.samplers import _bounds_of

    mask = tf.mask
    if tf.layout == "padded":
        bounds = _bounds_of(tf, None, f"{split} split")
        used, cut, left = padded_examples(bounds, mask, block_size)
        n = len(bounds) - 1
        note = f"data: {split}: {n:,} documents, one per row of {block_size} tokens"
        if cut:
            note += f"; {cut:,} longer than the row are truncated"
        if left:
            note += f"; {left:,} without a trained token in their row are skipped"
        log(note)
        if len(used) == 0:
            raise LlmkitError(
                f"{split} split: no document has a trained token within its first "
                f"{block_size + 1} tokens (data.block_size)"
            )
    elif mask is not None:
        trained = int(np.count_nonzero(mask))
        log(f"data: {split}: {trained:,} of {len(tf):,} tokens are trained targets")
        n_blocks = (len(tf) - 1) // block_size
        if n_blocks and len(trainable_blocks(mask, 0, n_blocks, block_size)) == 0:
            raise LlmkitError(f"{split} split: no block of {block_size} tokens has a trained token")


def _check_splits(splits: Any, name: str, chat: bool = False) -> None:
    columns = ("messages", "where") if chat else ("text",)
    for split in SPLITS:
        if split not in splits:
            have = ", ".join(splits) if hasattr(splits, "keys") else type(splits).__name__
            raise LlmkitError(f"dataset source {name!r} gave no {split!r} split (got {have})")
        for column in columns:
            if column not in splits[split].column_names:
                cols = ", ".join(splits[split].column_names)
                raise LlmkitError(
                    f"dataset source {name!r}: the {split} split has no {column!r} column ({cols})"
                )


def data_key(source: dict[str, Any], seed: int, fingerprint: str, tokenizer: Tokenizer) -> str:
    """A short hash naming the token files of this source, seed, input files and
    tokenizer."""
    blob = json.dumps(
        {
            "format": FORMAT_VERSION,
            "source": source,
            "seed": seed,
            "files": fingerprint,
            "tokenizer": hashlib.sha256(tokenizer.to_str().encode()).hexdigest(),
            "eos": tokenizer.eos_id,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def iter_texts(ds: datasets.Dataset, seed: int | None = None) -> Iterator[str]:
    """The non-empty texts of ``ds``, in a seeded shuffled order if ``seed`` is given (so a
    capped sample for tokenizer training spans the whole corpus)."""
    ds = ds.select_columns(["text"])
    if seed is not None:
        ds = ds.shuffle(seed=seed, keep_in_memory=True)
    for batch in ds.iter(batch_size=_WRITE_BATCH):
        for text in batch["text"]:
            if text:
                yield text


def count_text_bytes(texts: Iterable[str | None]) -> int:
    """UTF-8 bytes of ``texts`` (None counts as empty)."""
    return sum(len(t.encode("utf-8")) for t in texts if t)


class _Encoder:
    """The ``datasets.map`` function: ids of each text plus EOS, and its UTF-8 byte count.
    Holds the tokenizer as JSON so it pickles cheaply into worker processes."""

    def __init__(self, tokenizer_json: str, eos_id: int | None) -> None:
        self.tokenizer_json = tokenizer_json
        self.eos = [eos_id] if eos_id is not None else []
        self._tok: Any = None
        self._table: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None, "_table": None}

    def __call__(self, texts: list[str | None]) -> dict[str, list[Any]]:
        if self._tok is None:
            self._tok = Tokenizer.from_str(self.tokenizer_json)
            self._table = self._tok.char_table()
        clean = [t or "" for t in texts]
        fast = [self._table.encode(t) if self._table else None for t in clean]
        slow = [t for t, f in zip(clean, fast) if t and f is None]  # empty texts: no ids
        slow_ids = iter(self._tok.encode_batch(slow) if slow else [])
        eos = np.asarray(self.eos, dtype=np.int32)
        empty = eos[:0] if self._table else []  # the same type as the others in the batch
        ids = [
            (np.concatenate([f, eos]) if f is not None else next(slow_ids) + self.eos)
            if t
            else empty
            for t, f in zip(clean, fast)
        ]
        return {"ids": ids, "n_bytes": [len(t.encode("utf-8")) for t in clean]}


def _map(
    ds: datasets.Dataset,
    encoder: Callable[..., Any],
    columns: list[str],
    features: Any,
    path: Path,
    num_proc: int,
) -> datasets.Dataset:
    """``datasets.map`` of ``encoder`` over ``columns`` in batches, cached beside ``path``
    (``<path>.arrow``, see :func:`map_cache`)."""
    procs = min(num_proc, max(len(ds), 1))
    with library_progress_bars():  # its "tokenizing <split>" bar on a terminal only
        return ds.map(
            encoder,
            batched=True,
            batch_size=_MAP_BATCH,
            input_columns=columns,
            remove_columns=ds.column_names,
            features=features,
            num_proc=procs if procs > 1 else None,
            cache_file_name=str(path.with_suffix(".arrow")),
            new_fingerprint=f"llmkit-{path.stem}",
            desc=f"tokenizing {path.stem.split('-')[0]}",
        )


@contextmanager
def map_cache(arrow: Path) -> Iterator[None]:
    """Around tokenizing with ``datasets.map`` into the cache ``arrow``: the cache files are
    removed afterwards (the ids live in the token file), also when it fails; a full disk is
    one line naming the file."""
    try:
        yield
    except OSError as exc:
        raise_if_full(exc, arrow)
        raise
    finally:
        for cached in arrow.parent.glob(f"{arrow.stem}*.arrow"):
            cached.unlink(missing_ok=True)


def tokenize_split(
    ds: datasets.Dataset,
    tokenizer: Tokenizer,
    path: str | Path,
    *,
    num_proc: int = 1,
    meta: dict[str, Any] | None = None,
) -> TokenFile:
    """Tokenize ``ds["text"]`` once (``datasets.map``, its cache beside ``path``) and stream
    the ids, EOS after each document, into the token file ``path``."""
    import datasets
    import pyarrow.compute as pc

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    seq = getattr(datasets, "List", None) or datasets.Sequence
    features = datasets.Features(
        {"ids": seq(datasets.Value("int32")), "n_bytes": datasets.Value("int64")}
    )
    arrow = path.with_suffix(".arrow")
    with map_cache(arrow):  # removed afterwards, also when tokenizing fails
        encoder = _Encoder(tokenizer.to_str(), tokenizer.eos_id)
        tokenized = _map(ds, encoder, ["text"], features, path, num_proc)
        dtype = token_dtype(tokenizer.vocab_size)
        info: dict[str, Any] = {
            **(meta or {}),
            "documents": len(tokenized),
            "n_bytes_text": 0,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "format": FORMAT_VERSION,
        }

        def chunks() -> Iterator[np.ndarray]:
            for table in tokenized.with_format("arrow").iter(batch_size=_WRITE_BATCH):
                info["n_bytes_text"] += int(pc.sum(table.column("n_bytes")).as_py() or 0)
                for chunk in pc.list_flatten(table.column("ids")).chunks:
                    yield chunk.to_numpy(zero_copy_only=False)

        write_token_file(chunks(), path, dtype, info)  # reads info once chunks are exhausted
    return TokenFile(path)


def tokenize_chat_split(
    ds: datasets.Dataset,
    tokenizer: Tokenizer,
    chat: Any,
    path: str | Path,
    *,
    num_proc: int = 1,
    meta: dict[str, Any] | None = None,
) -> TokenFile:
    """Tokenize the conversations of ``ds`` once (``datasets.map``, its cache beside
    ``path``), each rendered with the chat template, and stream the ids, their loss mask
    and the conversations' offsets into ``path`` and the files beside it."""
    import datasets
    import pyarrow.compute as pc

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    seq = getattr(datasets, "List", None) or datasets.Sequence
    features = datasets.Features(
        {
            "ids": seq(datasets.Value("int32")),
            "mask": seq(datasets.Value("uint8")),
            "n_bytes": datasets.Value("int64"),
        }
    )
    arrow = path.with_suffix(".arrow")
    encoder = ChatEncoder(
        tokenizer.to_str(), chat.template, tokenizer.template_tokens(), chat.mask_prompt
    )
    with map_cache(arrow):  # removed afterwards, also when tokenizing fails
        tokenized = _map(ds, encoder, ["messages", "where"], features, path, num_proc)
        info: dict[str, Any] = {
            **(meta or {}),
            "n_bytes_text": 0,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "format": FORMAT_VERSION,
        }

        def chunks() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
            for table in tokenized.with_format("arrow").iter(batch_size=_WRITE_BATCH):
                info["n_bytes_text"] += int(pc.sum(table.column("n_bytes")).as_py() or 0)
                ids = pc.list_flatten(table.column("ids")).to_numpy()
                mask = pc.list_flatten(table.column("mask")).to_numpy()
                lengths = pc.list_value_length(table.column("ids")).to_numpy()
                yield ids, mask, lengths

        dtype = token_dtype(tokenizer.vocab_size)
        write_masked_token_file(chunks(), path, dtype, info)
    return TokenFile(path)


# -- batches --------------------------------------------------------------------------------
