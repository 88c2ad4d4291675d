"""llm.c / nanoGPT ``.bin`` token shards, read and written.

The format (karpathy/llm.c, ``dev/data/data_common.py``; modded-nanogpt's FineWeb shards use
the same): a header of 256 little-endian ``int32`` (1024 bytes), then the token ids.

=========  ==========  ===========  ===================================
header[0]  header[1]   token dtype  written for
=========  ==========  ===========  ===================================
20240520   1           ``uint16``   GPT-2's tokenizer (50257 ids)
20240801   7           ``uint32``   Llama 3's tokenizer (128256 ids)
=========  ==========  ===========  ===================================

``header[2]`` is the number of tokens after the header (below 2³¹); the other 253 ints are
zero. Documents are not marked except by the tokenizer's EOS, which GPT-2 data puts *before*
each document (id 50256, ``<|endoftext|>``). nanoGPT's own ``train.bin``/``val.bin`` have no
header: bare ``uint16`` ids (:func:`read_llmc` with ``header=False``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmkit.errors import LlmkitError
from llmkit.files import replacing, writing

if TYPE_CHECKING:
    from llmkit.data.shards import ShardedTokens

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
#: magic -> (version, token dtype)
FORMATS: dict[int, tuple[int, np.dtype]] = {
    20240520: (1, np.dtype("<u2")),
    20240801: (7, np.dtype("<u4")),
}
MAGIC_BY_DTYPE = {dt.itemsize: magic for magic, (_, dt) in FORMATS.items()}
#: GPT-2's ``<|endoftext|>``: the document separator of GPT-2 ``.bin`` data.
GPT2_EOS = 50256
#: llm.c's limit on the tokens of one file.
MAX_TOKENS = 2**31 - 1


@dataclass(frozen=True)
class LlmcHeader:
    """What a ``.bin`` header says: its magic and version, the token count and dtype, and
    where the ids start (1024, or 0 for a headerless nanoGPT file)."""

    path: Path
    tokens: int
    dtype: np.dtype
    offset: int = HEADER_BYTES
    magic: int = 0
    version: int = 0


def read_header(path: str | Path) -> LlmcHeader:
    """Read and check a ``.bin`` header: a one-line error naming the file for a short file,
    an unknown magic or version, or a size that disagrees with the token count."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
        size = path.stat().st_size
    except OSError as exc:
        raise LlmkitError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if len(raw) < HEADER_BYTES:
        raise LlmkitError(
            f"{path}: {len(raw)} bytes, shorter than the 1024-byte llm.c header "
            "(a headerless nanoGPT file? use header = false)"
        )
    header = np.frombuffer(raw, dtype="<i4")
    magic, version, tokens = int(header[0]), int(header[1]), int(header[2])
    if magic not in FORMATS:
        known = ", ".join(str(m) for m in FORMATS)
        raise LlmkitError(
            f"{path}: header[0] is {magic}, not an llm.c magic number ({known}); "
            "not an llm.c .bin file"
        )
    want_version, dtype = FORMATS[magic]
    if version != want_version:
        raise LlmkitError(
            f"{path}: header[1] (version) is {version}; magic {magic} files have version "
            f"{want_version}"
        )
    want = HEADER_BYTES + tokens * dtype.itemsize
    if tokens < 0 or size != want:
        raise LlmkitError(
            f"{path}: header[2] says {tokens} tokens ({want} bytes with the header) but the "
            f"file has {size} bytes (truncated or corrupt)"
        )
    return LlmcHeader(path, tokens, dtype, HEADER_BYTES, magic, version)


def bare_header(path: str | Path, dtype: str | np.dtype = "<u2") -> LlmcHeader:
    """A headerless file of ids (nanoGPT's ``train.bin``) described as a header would."""
    path = Path(path)
    dt = np.dtype(dtype)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise LlmkitError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if size % dt.itemsize:
        raise LlmkitError(f"{path}: {size} bytes is not a whole number of {dt.name} ids")
    return LlmcHeader(path, size // dt.itemsize, dt, 0)


def header_bytes(n_tokens: int, dtype: str | np.dtype) -> bytes:
    """The 1024-byte header of a file of ``n_tokens`` ids of ``dtype`` (``uint16``: the
    GPT-2 format, ``uint32``: the Llama 3 format)."""
    dt = np.dtype(dtype)
    if dt.itemsize not in MAGIC_BY_DTYPE or dt.kind != "u":
        raise ValueError(f"llm.c files hold uint16 or uint32 ids, not {dt}")
    if not 0 <= n_tokens <= MAX_TOKENS:
        raise LlmkitError(f"{n_tokens} tokens do not fit one llm.c file (at most {MAX_TOKENS})")
    magic = MAGIC_BY_DTYPE[dt.itemsize]
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, FORMATS[magic][0], n_tokens)
    return header.tobytes()


def write_llmc(path: str | Path, tokens: Iterable[int] | np.ndarray, dtype: str = "uint16") -> Path:
    """Write ``tokens`` as an llm.c ``.bin`` file (under a temporary name, then renamed);
    an id that does not fit ``dtype`` is an error."""
    path = Path(path)
    dt = np.dtype(dtype).newbyteorder("<")
    ids = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(dt).max):
        raise LlmkitError(f"{path}: token ids outside 0..{np.iinfo(dt).max} do not fit {dt.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp, writing(path), open(tmp, "wb") as f:
        f.write(header_bytes(ids.size, dt))
        f.write(np.ascontiguousarray(ids.astype(dt, copy=False)).tobytes())
    return path


def read_llmc(
    paths: str | Path | Sequence[str | Path],
    *,
    eos_id: int | None = GPT2_EOS,
    vocab_size: int | None = None,
    header: bool = True,
    dtype: str = "uint16",
) -> ShardedTokens:
    """``.bin`` files as one token sequence in the given order, each memory-mapped past its
    header on first use (:class:`~llmkit.data.shards.ShardedTokens`): what every sampler
    takes. Only headers are read here. ``eos_id`` splits documents, when asked for them
    (``data.sampling = "padded"``); ``vocab_size``: each file's largest id is checked
    against it when the file is first opened. ``header=False`` reads headerless
    ``dtype`` files (nanoGPT's ``train.bin``)."""
    from llmkit.data.shards import Shard, ShardedTokens

    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise LlmkitError("no .bin file given")
    heads = [read_header(p) if header else bare_header(p, dtype) for p in paths]
    dtypes = {h.dtype.itemsize for h in heads}
    if len(dtypes) > 1:
        raise LlmkitError(
            f"{heads[0].path} and the other files mix uint16 and uint32 ids; "
            "give files of one format"
        )
    shards = [Shard(h.path, h.tokens, h.offset, header=h.magic) for h in heads]
    meta = {
        "source": f"llm.c .bin: {len(shards)} file(s) from {heads[0].path.parent}",
        "eos_id": eos_id,
        "vocab_size": vocab_size,
        "format": "llmc",
    }
    return ShardedTokens(shards, heads[0].dtype, meta, path=heads[0].path)
