"""Token ids already prepared: a token store written by ``llmkit data prepare`` (``path``),
or llm.c / nanoGPT ``.bin`` files (``paths`` and ``val_paths``).

The source says where the ids are (:meth:`TokenSource.token_source`); the data pipeline
(``llmkit.data.shards_open.prepare_tokens``) opens them lazily, so nothing is tokenized and
no tokenizer is trained. ``splits()`` decodes a store back into documents (for a small store:
re-tokenizing it, or checking it)."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmkit.components.dataset import dataset_dict, files_fingerprint, text_dataset, train_val_files
from llmkit.components.dataset.options import TokensOptions as Options
from llmkit.errors import LlmkitError
from llmkit.files import read_json

if TYPE_CHECKING:
    import datasets


class TokenSource:
    """A store directory or llm.c ``.bin`` files, handed to the data pipeline as they are."""

    Options = Options

    def __init__(self, options: Options) -> None:
        self.options = options

    def _dir(self) -> Path:
        return Path(self.options.path).expanduser()

    def token_source(self) -> dict[str, Any]:
        """Where the ids are: ``{"kind": "store", "path": DIR}`` or ``{"kind": "llmc",
        "train": [files], "validation": [files], "header": bool, "dtype": str}``, with
        ``verify``."""
        o = self.options
        if o.path and o.paths:
            raise LlmkitError("data.source: give path (a token store) or paths (.bin files)")
        if o.path:
            return {"kind": "store", "path": self._dir(), "verify": o.verify}
        if not o.paths:
            raise LlmkitError(
                "data.source: name a token store (path = DIR from `llmkit data prepare`) or "
                "llm.c .bin files (paths and val_paths)"
            )
        if o.val_paths is None:
            raise LlmkitError(
                "data.source.val_paths: name the validation .bin files (llm.c writes them as "
                "*_val_*.bin)"
            )
        train, val = train_val_files(o.paths, o.val_paths)
        return {
            "kind": "llmc",
            "train": train,
            "validation": val,
            "header": o.header,
            "dtype": o.dtype,
            "verify": o.verify,
        }

    def describe(self) -> str:
        o = self.options
        if o.path:
            return f"tokens: store {o.path}"
        return f"tokens: .bin files {', '.join(o.paths)}"

    def fingerprint(self) -> str:
        """Changes when the store's index (or the .bin files) change."""
        found = self.token_source()
        if found["kind"] == "store":
            index = found["path"] / "index.json"
            return hashlib.sha256(index.read_bytes()).hexdigest() if index.is_file() else ""
        return files_fingerprint([*found["train"], *found["validation"]])

    def splits(self, seed: int) -> datasets.DatasetDict:
        """The store's documents as text (its tokenizer decodes them, without the EOS that
        ends each); llm.c files carry no tokenizer and cannot be decoded here."""
        found = self.token_source()
        if found["kind"] != "store":
            raise LlmkitError(
                "data.source: .bin files hold ids only and cannot be read as text; they train "
                "as they are"
            )
        root = found["path"]
        index = read_json(root / "index.json") if (root / "index.json").is_file() else None
        if not isinstance(index, dict) or index.get("complete") is not True:
            raise LlmkitError(f"data.source.path: {root} is not a complete token store")
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(_inside(root, "tokenizer.json")))
        eos = (index.get("tokenizer") or {}).get("eos_id")
        parts = {}
        for split in ("train", "validation"):
            texts = [tok.decode(_strip(doc, eos)) for doc in _documents(root, index, split)]
            parts[split] = text_dataset({"text": texts})
        return dataset_dict(parts["train"], parts["validation"])


def _inside(root: Path, name: Any) -> Path:
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise LlmkitError(f"{root / 'index.json'}: {name!r} is not a file name inside {root}")
    path = root / name
    if path.resolve().parent != root.resolve():
        raise LlmkitError(f"{root / 'index.json'}: {name!r} leads outside {root}")
    return path


def _documents(root: Path, index: dict[str, Any], split: str) -> list[list[int]]:
    """The documents of a split, as lists of ids, read whole."""
    import numpy as np

    dtype = np.dtype(index.get("dtype", "uint16"))
    shards = ((index.get("splits") or {}).get(split) or {}).get("shards") or []
    ids, ends, base = [], [np.zeros(1, np.int64)], 0
    for entry in shards:
        path = _inside(root, entry.get("file"))
        part = np.fromfile(path, dtype=dtype, offset=int(entry.get("offset", 0)))
        ids.append(part)
        ends.append(np.fromfile(_inside(root, entry.get("docs")), dtype="<i8") + base)
        base += len(part)
    if not ids:
        raise LlmkitError(f"{root}: the {split} split has no shard")
    flat = np.concatenate(ids)
    bounds = np.concatenate(ends)
    return [flat[a:b].tolist() for a, b in itertools.pairwise(bounds)]


def _strip(doc: list[int], eos: int | None) -> list[int]:
    return doc[:-1] if eos is not None and doc and doc[-1] == eos else doc
