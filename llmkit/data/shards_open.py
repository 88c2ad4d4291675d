"""Opening token stores and llm.c files for training: the index checked (one-line errors
naming the file and the place), the tokenizer checked against the run's, the splits as
:class:`~llmkit.data.shards.ShardedTokens`.

:func:`prepare_tokens` is what :func:`~llmkit.data.prepare_data` does for a source that
holds token ids already (a source with ``token_source()``: the ``tokens`` dataset): no
tokenizer is trained and nothing is tokenized."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmkit.data.shards import (
    INDEX,
    SPLITS,
    STORE_FORMAT,
    STORE_VERSION,
    TOKENIZER,
    Shard,
    ShardedTokens,
    text_sha256,
)
from llmkit.errors import LlmkitError
from llmkit.files import read_json

if TYPE_CHECKING:
    from llmkit.data.prepare import PreparedData
    from llmkit.data.tokenizer import Tokenizer
    from llmkit.spec import ResolvedSpec


def _fail(index: Path, where: str, what: str) -> LlmkitError:
    return LlmkitError(f"{index}: {where}: {what}")


def _integer(value: Any, index: Path, where: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _fail(index, where, f"expected an integer ≥ {low}, got {value!r}")
    return value


def inside(root: Path, name: Any, index: Path, where: str) -> Path:
    """``root/name`` for a plain file name whose real path lies in ``root``; a one-line
    error for a path (``../x.bin``, ``/etc/x``) or a link that leads out."""
    bad = not isinstance(name, str) or name in ("", ".", "..")
    if bad or any(c in name for c in "/\\\0"):
        raise _fail(index, where, f"{name!r} is not a file name inside {root}")
    path = root / name
    real = path.resolve()
    if real.parent != root.resolve():
        raise _fail(index, where, f"{name!r} leads to {real}, outside {root}")
    return path


def read_index(directory: str | Path) -> dict[str, Any]:
    """A complete store's index, its shape checked."""
    root = Path(directory).expanduser()
    index_path = root / INDEX
    if not root.is_dir():
        raise LlmkitError(f"data.source.path: token store not found: {root}")
    if not index_path.is_file():
        raise LlmkitError(f"{root}: no {INDEX}: not a token store written by `llmkit data prepare`")
    index = read_json(index_path)
    if not isinstance(index, dict) or index.get("format") != STORE_FORMAT:
        raise LlmkitError(f"{index_path}: not the index of a token store (format)")
    version = index.get("version")
    if not isinstance(version, int) or version > STORE_VERSION:
        raise _fail(index_path, "version", f"{version!r}: made by a newer llmkit")
    if index.get("complete") is not True:
        raise LlmkitError(
            f"{root}: the store is not complete (`llmkit data prepare` was stopped); run it "
            "again to finish it"
        )
    if index.get("dtype") not in ("uint16", "uint32"):
        raise _fail(index_path, "dtype", f"{index.get('dtype')!r} is not uint16 or uint32")
    tok = index.get("tokenizer")
    if not isinstance(tok, dict) or not isinstance(tok.get("sha256"), str):
        raise _fail(index_path, "tokenizer", "missing or without sha256")
    _integer(tok.get("vocab_size"), index_path, "tokenizer.vocab_size", 1)
    splits = index.get("splits")
    if not isinstance(splits, dict):
        raise _fail(index_path, "splits", "missing")
    return index


def store_shards(root: Path, index: dict[str, Any], split: str) -> list[Shard]:
    """The shards of ``split`` as the index lists them, every name and number checked."""
    index_path = root / INDEX
    part = index["splits"].get(split)
    if not isinstance(part, dict) or not isinstance(part.get("shards"), list):
        raise _fail(index_path, f"splits.{split}", "missing")
    shards = []
    for i, entry in enumerate(part["shards"]):
        where = f"splits.{split}.shards[{i}]"
        if not isinstance(entry, dict):
            raise _fail(index_path, where, "not a table")
        path = inside(root, entry.get("file"), index_path, f"{where}.file")
        docs = inside(root, entry.get("docs"), index_path, f"{where}.docs")
        offset = _integer(entry.get("offset", 0), index_path, f"{where}.offset")
        if offset not in (0, 1024):
            raise _fail(index_path, f"{where}.offset", f"{offset} is not 0 or 1024")
        shards.append(
            Shard(
                path,
                _integer(entry.get("tokens"), index_path, f"{where}.tokens"),
                offset,
                _integer(entry.get("documents"), index_path, f"{where}.documents"),
                _integer(entry.get("n_bytes_text", 0), index_path, f"{where}.n_bytes_text"),
                _integer(entry.get("max_id", -1), index_path, f"{where}.max_id", -1),
                _hex(entry.get("sha256"), index_path, f"{where}.sha256"),
                docs,
                _hex(entry.get("docs_sha256"), index_path, f"{where}.docs_sha256"),
                20240520 if offset and index["dtype"] == "uint16" else (20240801 if offset else 0),
            )
        )
    total = part.get("tokens")
    if total is not None and total != sum(s.tokens for s in shards):
        raise _fail(index_path, f"splits.{split}.tokens", "is not the sum of its shards'")
    return shards


def _hex(value: Any, index: Path, where: str) -> str:
    if (
        not isinstance(value, str)
        or len(value) != 64
        or not all(c in "0123456789abcdef" for c in value)
    ):
        raise _fail(index, where, "missing or not a SHA-256 in hex")
    return value


def open_store(
    directory: str | Path, split: str, *, verify: bool = True, index: dict[str, Any] | None = None
) -> ShardedTokens:
    """One split of a store: nothing is read but the index (shards are checked when first
    read); its largest ids are checked against the store's tokenizer now."""
    root = Path(directory).expanduser()
    index = read_index(root) if index is None else index
    shards = store_shards(root, index, split)
    tok = index["tokenizer"]
    vocab = int(tok["vocab_size"])
    for shard in shards:
        if shard.max_id is not None and shard.max_id >= vocab:
            raise LlmkitError(
                f"{shard.path}: token id {shard.max_id} (the index's max_id) is outside the "
                f"store's tokenizer of {vocab} ids"
            )
    meta = {
        "source": index.get("source") or f"token store {root}",
        "eos_id": tok.get("eos_id"),
        "vocab_size": vocab,
        "format": "llmkit-shards",
        "store": str(root),
        "tokenizer_sha256": tok["sha256"],
    }
    return ShardedTokens(shards, index["dtype"], meta, path=root / INDEX, verify=verify)


# -- a run's data from token ids ---------------------------------------------------------------


def prepare_tokens(
    rs: ResolvedSpec,
    source: Any,
    run_dir: Path,
    tokenizer: Tokenizer | None,
    log: Callable[[str], None],
) -> PreparedData:
    """The run's tokenizer and splits from a source of token ids (``source.token_source()``):
    a store (its tokenizer becomes the run's; a different ``tokenizer.path`` or given
    tokenizer is an error) or llm.c files (``tokenizer.path`` names their tokenizer)."""
    from llmkit.data.prepare import PreparedData, _describe_rows

    spec = rs.spec
    found = source.token_source()
    verify = bool(found.get("verify", True))
    if found["kind"] == "store":
        root = Path(found["path"]).expanduser()
        index = read_index(root)
        tokenizer = _store_tokenizer(root, index, spec.tokenizer.path, tokenizer, run_dir)
        train, val = (open_store(root, s, verify=verify, index=index) for s in SPLITS)
        key = index["tokenizer"]["sha256"][:12]
        where = str(root)
    else:
        tokenizer = _llmc_tokenizer(spec, tokenizer, run_dir)
        train, val = (_llmc(found, s, tokenizer, verify) for s in SPLITS)
        key, where = "", "llm.c files"
    for split, tf in (("train", train), ("validation", val)):
        if len(tf) == 0:
            raise LlmkitError(f"data.source: {where}: the {split} split has no tokens")
        log(f"data: {split}: {len(tf):,} tokens in {len(tf.shards)} shard(s) ({where})")
    description = str(train.meta.get("source") or source.describe())
    log(f"data: {description}")
    block_size = spec.data.block_size or rs.model.max_seq_len
    for split, tf in (("train", train), ("validation", val)):
        tf.layout = "padded" if spec.data.sampling == "padded" else "packed"
        if spec.data.sampling == "padded":
            _describe_rows(tf, split, block_size, log)
    return PreparedData(tokenizer, train, val, description, Path(train.path).parent, key)


def _store_tokenizer(
    root: Path,
    index: dict[str, Any],
    spec_path: str | None,
    given: Tokenizer | None,
    run_dir: Path,
) -> Tokenizer:
    """The store's tokenizer, checked against its index, against ``tokenizer.path``,
    against a tokenizer handed in and against the run's copy; copied into the run."""
    from llmkit.data.tokenizer import Tokenizer

    info = index["tokenizer"]
    want = info["sha256"]
    file = inside(root, info.get("file", TOKENIZER), root / INDEX, "tokenizer.file")
    tok = Tokenizer.load(file, None, info.get("eos_token"))
    if text_sha256(tok.to_str()) != want:
        raise LlmkitError(f"{file}: not the tokenizer the index names (sha256 {want[:12]}…)")
    others = [
        (f"tokenizer.path {spec_path}", Tokenizer.load(spec_path) if spec_path else None),
        ("the tokenizer given", given),
        (str(run_dir / TOKENIZER), _maybe_load(run_dir / TOKENIZER)),
    ]
    for what, other in others:
        if other is not None and text_sha256(other.to_str()) != want:
            raise LlmkitError(
                f"{what} is not the tokenizer of the token store {root} (its sha256 differs); "
                "leave tokenizer.path unset to use the store's"
            )
    if not (run_dir / TOKENIZER).exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, run_dir / TOKENIZER)
    return given if given is not None else tok


def _maybe_load(path: Path) -> Tokenizer | None:
    from llmkit.data.tokenizer import Tokenizer

    return Tokenizer.load(path) if path.is_file() else None


def _llmc_tokenizer(spec: Any, given: Tokenizer | None, run_dir: Path) -> Tokenizer:
    from llmkit.data.tokenizer import Tokenizer

    if given is not None:
        return given
    own = run_dir / TOKENIZER
    eos = spec.tokenizer.special_tokens[0] if spec.tokenizer.special_tokens else None
    if spec.tokenizer.path:
        tok = Tokenizer.load(spec.tokenizer.path, "pretrained", eos)
        if not own.exists():
            tok.save(own)
        return tok
    if own.is_file():  # a resumed run
        return Tokenizer.load(own, None, eos)
    raise LlmkitError(
        "data.source: llm.c .bin files hold token ids only: set tokenizer.path to the "
        "tokenizer.json that made them (GPT-2 bins: GPT-2's tokenizer.json, from "
        "huggingface.co/openai-community/gpt2)"
    )


def _llmc(found: dict[str, Any], split: str, tok: Tokenizer, verify: bool) -> ShardedTokens:
    from llmkit.data.llmc import read_llmc

    out = read_llmc(
        found[split],
        eos_id=tok.eos_id,
        vocab_size=tok.vocab_size,
        header=bool(found.get("header", True)),
        dtype=str(found.get("dtype", "uint16")),
    )
    out.verify = verify
    return out
