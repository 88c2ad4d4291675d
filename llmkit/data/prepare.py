"""From a corpus source to token files: build the source, train (or load) the tokenizer,
tokenize each split once with ``datasets.map`` and stream the ids into a token file whose
name hashes the source, its input files, the seed and the tokenizer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmkit.data.tokenizer import Tokenizer, build_tokenizer
from llmkit.data.tokens import FORMAT_VERSION, TokenFile, _reusable, token_dtype, write_token_file
from llmkit.errors import LlmkitError

if TYPE_CHECKING:
    import datasets

    from llmkit.spec import ResolvedSpec

SPLITS = ("train", "validation")
_MAP_BATCH = 256  # documents per tokenization batch
_WRITE_BATCH = 4096  # documents per write to the token file


@dataclass
class PreparedData:
    """What training needs from the data side."""

    tokenizer: Tokenizer
    train: TokenFile
    validation: TokenFile
    source_description: str
    cache_dir: Path | None = None
    key: str = ""


def prepare_data(
    rs: ResolvedSpec,
    run_dir: str | Path,
    tokenizer: Tokenizer | None = None,
    *,
    log: Callable[[str], None] = print,
) -> PreparedData:
    """Build the source, get its splits, build/load the tokenizer (``run_dir/tokenizer.json``)
    and tokenize each split into a cached token file, reusing files made before."""
    if rs.dataset is None:
        raise LlmkitError("no dataset source: the registry has no 'dataset' kind")
    run_dir = Path(run_dir)
    spec = rs.spec
    seed = spec.train.seed
    source = rs.dataset.build(rs.dataset.options)
    splits = source.splits(seed)
    _check_splits(splits, rs.dataset.name)
    description = source.describe()
    log(f"data: {description}")

    if tokenizer is None:
        tokenizer = build_tokenizer(
            spec.tokenizer,
            lambda: iter_texts(splits["train"], seed),
            run_dir / "tokenizer.json",
            spec.model.vocab_size,
            log=log,
        )
    if tokenizer.eos_id is None:
        log("data: the tokenizer has no special token; documents are joined without separator")

    fingerprint = getattr(source, "fingerprint", None)
    key = data_key(
        rs.dataset.to_dict(), seed, fingerprint() if callable(fingerprint) else "", tokenizer
    )
    cache_dir = Path(spec.data.cache_dir).expanduser() if spec.data.cache_dir else run_dir / "data"
    cache_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, TokenFile] = {}
    for split in SPLITS:
        path = cache_dir / f"{split}-{key}.bin"
        if _reusable(path):
            files[split] = TokenFile(path)
            log(f"data: {split}: {len(files[split]):,} tokens (cached {path.name})")
            continue
        files[split] = tokenize_split(
            splits[split], tokenizer, path, num_proc=spec.data.num_proc, meta={"key": key}
        )
        tf = files[split]
        log(f"data: {split}: {len(tf):,} tokens from {tf.n_bytes_text:,} bytes -> {path}")
    if len(files["train"]) == 0:
        raise LlmkitError(f"data.source: {description}: the training split has no text")
    return PreparedData(tokenizer, files["train"], files["validation"], description, cache_dir, key)


def _check_splits(splits: Any, name: str) -> None:
    for split in SPLITS:
        if split not in splits:
            have = ", ".join(splits) if hasattr(splits, "keys") else type(splits).__name__
            raise LlmkitError(f"dataset source {name!r} gave no {split!r} split (got {have})")
        if "text" not in splits[split].column_names:
            cols = ", ".join(splits[split].column_names)
            raise LlmkitError(
                f"dataset source {name!r}: the {split} split has no 'text' column ({cols})"
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

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}

    def __call__(self, texts: list[str | None]) -> dict[str, list[Any]]:
        if self._tok is None:
            from tokenizers import Tokenizer as HFTokenizer

            self._tok = HFTokenizer.from_str(self.tokenizer_json)
        clean = [t or "" for t in texts]
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encs = encode(clean, add_special_tokens=False)
        ids = [e.ids + self.eos if t else [] for e, t in zip(encs, clean)]
        return {"ids": ids, "n_bytes": [len(t.encode("utf-8")) for t in clean]}


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
    procs = min(num_proc, max(len(ds), 1))
    tokenized = ds.map(
        _Encoder(tokenizer.to_str(), tokenizer.eos_id),
        batched=True,
        batch_size=_MAP_BATCH,
        input_columns=["text"],
        remove_columns=ds.column_names,
        features=features,
        num_proc=procs if procs > 1 else None,
        cache_file_name=str(arrow),
        new_fingerprint=f"llmkit-{path.stem}",
        desc=f"tokenizing {path.stem.split('-')[0]}",
    )
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
    for cached in path.parent.glob(f"{arrow.stem}*.arrow"):  # the ids live in the .bin now
        cached.unlink(missing_ok=True)
    return TokenFile(path)


# -- batches --------------------------------------------------------------------------------
