"""The store of prepared data that runs share: a trained tokenizer and the token files made
with it, kept once and found again by any later run that would make the same ones.

A run trains its tokenizer and tokenizes its corpus into its own directory; with
``data.shared_cache`` (the default) it also keeps them here, so the next run over the same
input files (the source's ``fingerprint()``: their content up to 64 MiB in all, else path,
size and modification time; see :func:`llmkit.components.dataset.files_fingerprint`), source
options, seed and tokenizer spec takes them from the store instead of loading the corpus with
``datasets``, training and tokenizing again. Keyed by content, a store made on one machine
serves a copy of the corpus at another path on another (``LLMKIT_CACHE_DIR`` pointing at a
copy of the store), and that machine needs no ``datasets`` for it. Token files are hard links
where the store and the run share a file system (copies otherwise; a copy into the store only
up to :data:`COPY_LIMIT`), so the run directory stays whole if the store is deleted.

Layout under :func:`store_root` (``$LLMKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/llmkit``,
else ``~/.cache/llmkit``)::

    tokenizers/<recipe>.json               tokenizer trained for a recipe (see recipe_key)
    tokens/<split>-<key>.{bin,json,...}    token files, named as in a run's data directory
    cpu-peaks.json                         measured CPU matmul peaks, for MFU (hardware.py)
    kernels/window_native-<key>.so         the compiled CPU window kernel (kernels/window_native.py)

Every file enters under a temporary name and is renamed into place, the token file's JSON
sidecar last, so a reader never takes a half-written entry (:func:`tokens._reusable` checks
sizes too). Removing the directory is always safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from llmkit.data.tokens import DOCS_SUFFIX, FORMAT_VERSION, MASK_SUFFIX, _reusable, sidecar
from llmkit.files import replacing, store_root

#: The file of measured CPU peaks under the store's root (:func:`llmkit.hardware.peak_flops`).
PEAKS_FILE = "cpu-peaks.json"
#: Largest token data copied into the store when hard links are impossible (bytes).
COPY_LIMIT = 1 << 30


def recipe_key(
    source: dict[str, Any], seed: int, fingerprint: str, tokenizer: dict[str, Any], vocab: int
) -> str:
    """A short hash of everything a trained tokenizer depends on: the source's options and
    input files, the seed (its training sample) and the tokenizer spec with the model's
    vocabulary size (the default BPE size)."""
    blob = json.dumps(
        {
            "format": FORMAT_VERSION,
            "source": source,
            "seed": seed,
            "files": fingerprint,
            "tokenizer": tokenizer,
            "vocab": vocab,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def link_or_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """``dst`` becomes a hard link to ``src``, or a copy where links are impossible."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _token_parts(path: Path) -> list[Path]:
    """The files of a token file, the JSON sidecar last."""
    parts = [path, path.with_suffix(MASK_SUFFIX), path.with_suffix(DOCS_SUFFIX)]
    return [p for p in parts if p.is_file()] + [sidecar(path)]


def _place(files: list[Path], dst_dir: Path, copy_limit: int | None) -> None:
    """Link (or copy) ``files`` into ``dst_dir`` under their names, each through a temporary
    name, in order. Raises ``OSError`` when a copy would pass ``copy_limit`` bytes."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    copied = 0
    for src in files:
        final = dst_dir / src.name
        with replacing(final) as tmp:
            try:
                os.link(src, tmp)
            except OSError as exc:
                copied += src.stat().st_size
                if copy_limit is not None and copied > copy_limit:
                    too_big = f"{src.name}: copies over {copy_limit:,} bytes are not kept"
                    raise OSError(too_big) from exc
                shutil.copy2(src, tmp)


class DataStore:
    """Tokenizers and token files under ``root`` (default :func:`store_root`)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or store_root()

    def tokenizer(self, recipe: str) -> Path | None:
        """The stored tokenizer of ``recipe``, if there is one."""
        path = self.root / "tokenizers" / f"{recipe}.json"
        return path if path.is_file() else None

    def keep_tokenizer(self, recipe: str, src: Path) -> None:
        """Store the tokenizer file ``src`` for ``recipe`` (a copy: the run's may change)."""
        final = self.root / "tokenizers" / f"{recipe}.json"
        final.parent.mkdir(parents=True, exist_ok=True)
        with replacing(final) as tmp:
            shutil.copyfile(src, tmp)

    def fetch_tokens(self, name: str, dst_dir: Path) -> bool:
        """Place the stored token file ``name`` (``<split>-<key>.bin``) in ``dst_dir``;
        False when the store has no whole copy of it."""
        src = self.root / "tokens" / name
        if not _reusable(src):
            return False
        _place(_token_parts(src), dst_dir, None)
        return True

    def keep_tokens(self, path: Path) -> None:
        """Store the token file ``path`` (hard links; copies up to :data:`COPY_LIMIT`)."""
        _place(_token_parts(path), self.root / "tokens", COPY_LIMIT)
