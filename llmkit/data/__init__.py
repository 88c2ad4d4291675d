"""From a corpus source to batches of token ids.

:func:`prepare_data` builds the spec's source, trains (or loads) the tokenizer, tokenizes
each split once with ``datasets.map`` and streams the ids into a flat token file
``<cache>/<split>-<key>.bin`` (``uint16`` for vocabularies up to 65535, else ``uint32``)
beside a JSON sidecar. ``key`` hashes the source, its input files, the seed and the
tokenizer, so a changed corpus or tokenizer never reuses a stale file, and an unchanged one
is never tokenized twice.

:class:`BlockSampler` cuts a :class:`TokenFile` into packed, non-overlapping blocks of
``block_size + 1`` tokens and visits them in a seeded per-epoch order, resumably and
sharded across ranks; :func:`eval_batches` yields the same evenly spaced validation blocks
at every evaluation.
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmkit.data.tokenizer import Tokenizer, build_tokenizer
from llmkit.errors import LlmkitError

if TYPE_CHECKING:
    import datasets
    import torch

    from llmkit.spec import ResolvedSpec

#: Bumped when the token-file layout changes, so older caches are not reused.
FORMAT_VERSION = 1
SPLITS = ("train", "validation")
_MAP_BATCH = 256  # documents per tokenization batch
_WRITE_BATCH = 4096  # documents per write to the token file


# -- token files ----------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab ≤ 65535), else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


class TokenFile:
    """A flat file of token ids, memory-mapped read-only, with its JSON sidecar
    (``tokens``, ``dtype``, ``documents``, ``n_bytes_text``: UTF-8 bytes of the text it
    came from, for loss per byte)."""

    def __init__(self, path: str | Path, dtype: str | np.dtype | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise LlmkitError(f"token file not found: {self.path}")
        side = sidecar(self.path)
        self.meta: dict[str, Any] = json.loads(side.read_text()) if side.is_file() else {}
        self.dtype = np.dtype(dtype or self.meta.get("dtype") or np.uint16)
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise LlmkitError(f"{self.path}: size {size} is not a multiple of {self.dtype}")
        self._n = size // self.dtype.itemsize
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        """The ids, as a read-only ``np.memmap`` (opened on first use)."""
        if self._array is None:
            if self._n == 0:
                self._array = np.zeros(0, self.dtype)
            else:
                self._array = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._array

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        return self.array[index]

    @property
    def n_bytes_text(self) -> int | None:
        """UTF-8 bytes of the split's text, if recorded."""
        n = self.meta.get("n_bytes_text")
        return int(n) if n is not None else None

    @property
    def n_documents(self) -> int | None:
        n = self.meta.get("documents")
        return int(n) if n is not None else None

    @property
    def bytes_per_token(self) -> float | None:
        """Text bytes per token (EOS tokens included), to turn loss/token into loss/byte."""
        n = self.n_bytes_text
        return n / self._n if n is not None and self._n else None

    def __getstate__(self) -> dict[str, Any]:  # picklable for DataLoader workers
        return {**self.__dict__, "_array": None}

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, {self._n} tokens, {self.dtype})"


def sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def write_token_file(
    chunks: Iterable[np.ndarray], path: str | Path, dtype: np.dtype, meta: dict[str, Any]
) -> TokenFile:
    """Stream id arrays into ``path`` (a temp name, then renamed) and write its sidecar:
    ``meta`` (read after ``chunks`` is exhausted) plus ``tokens`` and ``dtype``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    side_tmp = tmp.with_suffix(".json.tmp")
    n = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                arr = np.asarray(chunk)
                if arr.size and int(arr.max()) > np.iinfo(dtype).max:
                    raise LlmkitError(f"token id {int(arr.max())} does not fit {dtype}")
                arr.astype(dtype, copy=False).tofile(f)
                n += arr.size
        side_tmp.write_text(json.dumps({**meta, "tokens": n, "dtype": dtype.name}, indent=1))
        os.replace(tmp, path)
        os.replace(side_tmp, sidecar(path))
    finally:
        tmp.unlink(missing_ok=True)
        side_tmp.unlink(missing_ok=True)
    return TokenFile(path)


def _reusable(path: Path) -> bool:
    side = sidecar(path)
    if not (path.is_file() and side.is_file()):
        return False
    try:
        meta = json.loads(side.read_text())
        size = int(meta["tokens"]) * np.dtype(meta["dtype"]).itemsize
    except (ValueError, KeyError, TypeError):
        return False
    return path.stat().st_size == size


# -- preparing a run's data -----------------------------------------------------------------


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


def _as_array(data: TokenFile | np.ndarray) -> np.ndarray:
    return data.array if isinstance(data, TokenFile) else np.asarray(data)


def _blocks(array: np.ndarray, starts: np.ndarray, block_size: int) -> tuple[Any, Any]:
    import torch

    index = starts[:, None] + np.arange(block_size + 1)[None, :]
    block = torch.from_numpy(array[index].astype(np.int64))
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


def count_blocks(n_tokens: int, block_size: int, what: str) -> int:
    """Whole blocks of ``block_size`` (+1 target) tokens in ``n_tokens``; an error naming
    ``what`` when there is not even one."""
    if block_size < 1:
        raise LlmkitError(f"block_size must be positive, got {block_size}")
    if n_tokens < block_size + 1:
        raise LlmkitError(
            f"{what}: corpus shorter than one block: {n_tokens} tokens < block_size+1 "
            f"({block_size + 1}); use more text or a smaller data.block_size"
        )
    return (n_tokens - 1) // block_size


class _Sampler(ABC):
    """What every training sampler holds: the tokens, the block size, the seed and this
    rank's place; construction fails clearly for a bad rank or a corpus under one block."""

    def __init__(
        self,
        data: TokenFile | np.ndarray,
        block_size: int,
        seed: int = 0,
        *,
        rank: int = 0,
        world_size: int = 1,
        name: str = "train",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.data = data
        self.block_size = block_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.n_blocks = count_blocks(len(data), block_size, f"{name} split")
        self._start(name)

    @abstractmethod
    def _start(self, name: str) -> None:
        """What a sampler adds to the shared state (its position), set up at construction."""


class BlockSampler(_Sampler):
    """Packed training blocks: block ``i`` is tokens ``[s + i·B, s + i·B + B + 1)`` for
    ``B = block_size`` (x = block[:-1], y = block[1:]), visited in a permutation seeded by
    ``(seed, epoch)``; the grid offset ``s`` is 0 in the first epoch and a seeded shift
    within the spare tokens afterwards. With ``world_size > 1`` rank ``r`` takes every
    ``world_size``-th block of the permutation from ``r`` on: disjoint shares of equal size,
    and one step of N ranks reads exactly the blocks one process reads with an N× batch."""

    def _start(self, name: str) -> None:
        ws = self.world_size
        if self.n_blocks >= 2 * ws:  # keep a block spare so epochs can shift the grid
            self.n_blocks -= 1
        self.spare = len(self.data) - 1 - self.n_blocks * self.block_size
        self.blocks_per_rank = self.n_blocks // ws
        if self.blocks_per_rank == 0:
            raise LlmkitError(
                f"{name} split: {self.n_blocks} block(s) of {self.block_size} tokens cannot be "
                f"shared by {ws} ranks"
            )
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order = np.zeros(0, np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """This rank's block indices for ``epoch``."""
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed % 2**63, epoch])
            perm = rng.permutation(self.n_blocks)
            used = self.blocks_per_rank * self.world_size
            self._order = perm[self.rank : used : self.world_size]
            self._order_epoch = epoch
        return self._order

    def _next(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The next block indices and the epoch each belongs to."""
        blocks, epochs = [], []
        need = batch_size
        while need:
            if self.index >= self.blocks_per_rank:
                self.epoch += 1
                self.index = 0
            take = self.order(self.epoch)[self.index : self.index + need]
            blocks.append(take)
            epochs.append(np.full(len(take), self.epoch))
            self.index += len(take)
            need -= len(take)
        return np.concatenate(blocks), np.concatenate(epochs)

    def next_indices(self, batch_size: int) -> np.ndarray:
        """The next ``batch_size`` block indices, moving to the next epoch as needed."""
        return self._next(batch_size)[0]

    def shift(self, epoch: int) -> int:
        """Where the block grid starts in ``epoch``: 0 in the first epoch, then a seeded
        offset, so later epochs cut the text at new places."""
        if epoch == 0 or self.spare == 0:
            return 0
        return int(np.random.default_rng([self.seed % 2**63, epoch, 1]).integers(self.spare + 1))

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, LongTensors of shape (batch_size, block_size)."""
        blocks, epochs = self._next(batch_size)
        shifts = np.array([self.shift(int(e)) for e in epochs], dtype=np.int64)
        return _blocks(_as_array(self.data), blocks * self.block_size + shifts, self.block_size)

    @property
    def tokens_per_epoch(self) -> int:
        """Tokens this rank sees per epoch (inputs only)."""
        return self.blocks_per_rank * self.block_size

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": int(self.epoch),
            "index": int(self.index),
            "world_size": int(self.world_size),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position; one saved by another number of ranks maps to the same place
        in the epoch (ranks move in lockstep, so ``index · world_size`` blocks are done)."""
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
            saved_world = int(state.get("world_size", 1))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            msg = f"bad sampler state {state!r}: needs integer epoch and index"
            raise LlmkitError(msg) from exc
        if saved_world != self.world_size and saved_world > 0:
            index = index * saved_world // self.world_size
        if epoch < 0 or not 0 <= index <= self.blocks_per_rank:
            raise LlmkitError(
                f"sampler state {state!r} does not fit this data "
                f"({self.blocks_per_rank} blocks per rank)"
            )
        self.epoch, self.index = epoch, index


class RandomWindowSampler(_Sampler):
    """Windows of ``block_size + 1`` tokens starting anywhere, drawn i.i.d. (nanoGPT's
    ``get_batch``). Batch ``n`` is a function of ``(seed, rank, n)`` alone, so the state is
    one counter and a resumed run draws exactly the batches an uninterrupted one would."""

    def _start(self, name: str) -> None:
        self.draws = 0

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed % 2**63, self.rank, self.draws, 2])
        self.draws += 1
        high = len(self.data) - self.block_size  # last valid start + 1
        starts = rng.integers(0, high, size=batch_size)
        return _blocks(_as_array(self.data), starts, self.block_size)

    def state_dict(self) -> dict[str, int]:
        return {"draws": int(self.draws)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.draws = int(state["draws"])
        except (KeyError, TypeError, ValueError) as exc:
            raise LlmkitError(f"bad sampler state {state!r}") from exc


def make_sampler(
    kind: str, data: TokenFile | np.ndarray, block_size: int, seed: int, **kw: Any
) -> BlockSampler | RandomWindowSampler:
    """The training sampler named by ``data.sampling``."""
    cls = RandomWindowSampler if kind == "random" else BlockSampler
    return cls(data, block_size, seed, **kw)


def eval_batches(
    token_file: TokenFile | np.ndarray, block_size: int, batch_size: int, n_batches: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` batches of blocks evenly spaced over the file — the same blocks every
    time. A file with fewer blocks gives each block once (the last batch may be short)."""
    array = _as_array(token_file)
    avail = count_blocks(len(array), block_size, "validation split")
    want = batch_size * n_batches
    if avail <= want:
        blocks = np.arange(avail)
    else:
        blocks = np.round(np.linspace(0, avail - 1, want)).astype(np.int64)
    for i in range(0, len(blocks), batch_size):
        yield _blocks(array, blocks[i : i + batch_size] * block_size, block_size)
