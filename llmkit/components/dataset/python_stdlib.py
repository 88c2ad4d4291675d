"""The running Python's standard library sources: a corpus every machine has, no download."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

from llmkit.components.dataset import (
    dataset_dict,
    human_bytes,
    split_by_hash,
    text_dataset,
    unit_hash,
)
from llmkit.components.dataset.options import PythonStdlibOptions as Options
from llmkit.errors import LlmkitError

if TYPE_CHECKING:
    import datasets

#: Directories never read: installed packages, not the standard library.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
#: Test-suite directories (``test/``, ``tests/``, ``idlelib/idle_test``, ``lib2to3/tests``...).
TEST_DIRS = frozenset({"test", "tests", "idle_test"})


class PythonStdlib:
    """The ``.py`` files of ``sysconfig.get_paths()["stdlib"]``, one document per file, split
    into train/validation by a seeded hash of each file's relative path."""

    Options = Options

    def __init__(self, options: Options | None = None, root: str | Path | None = None) -> None:
        self.options = options or Options()
        self.root = Path(root or sysconfig.get_paths()["stdlib"])
        self._summary: str | None = None

    def files(self) -> list[tuple[str, Path]]:
        """(relative path, path) of every eligible ``.py`` file, sorted by relative path."""
        if not self.root.is_dir():
            raise LlmkitError(f"python-stdlib: standard library directory not found: {self.root}")
        skip = EXCLUDED_DIRS | (frozenset() if self.options.include_tests else TEST_DIRS)
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if d not in skip]  # prune, don't descend
            base = Path(dirpath)
            for name in filenames:
                if name.endswith(".py"):
                    p = base / name
                    out.append((p.relative_to(self.root).as_posix(), p))
        out.sort()
        if not out:
            raise LlmkitError(f"python-stdlib: no .py files under {self.root}")
        return out

    def fingerprint(self) -> str:
        return f"{sys.version}|{self.root}"

    def _chosen(self, seed: int) -> list[tuple[str, str]]:
        """(relative path, text) of the files used, after the caps, sorted by path."""
        files = self.files()
        capped = self.options.max_files is not None or self.options.max_bytes is not None
        if capped:  # a seeded order, fixed per file, decides which files are kept
            files.sort(key=lambda f: unit_hash(seed, f[0], "order"))
        texts: list[tuple[str, str]] = []
        total = 0
        for rel, p in files:
            if self.options.max_files is not None and len(texts) >= self.options.max_files:
                break
            try:
                text = p.read_bytes().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            size = len(text.encode("utf-8"))
            if (
                self.options.max_bytes is not None
                and texts
                and total + size > self.options.max_bytes
            ):
                break
            texts.append((rel, text))
            total += size
        texts.sort()
        return texts

    def splits(self, seed: int) -> datasets.DatasetDict:
        chosen = self._chosen(seed)
        if len(chosen) < 2:
            raise LlmkitError(
                f"python-stdlib: {len(chosen)} usable file(s); need at least 2 to split "
                "into train and validation (raise max_files / max_bytes)"
            )
        is_val = split_by_hash([rel for rel, _ in chosen], seed, self.options.val_fraction)
        parts: dict[bool, dict[str, list[str]]] = {
            v: {"text": [], "path": []} for v in (False, True)
        }
        for (rel, text), v in zip(chosen, is_val):
            parts[v]["text"].append(text)
            parts[v]["path"].append(rel)
        sizes = {v: sum(len(t.encode("utf-8")) for t in parts[v]["text"]) for v in parts}
        self._summary = (
            f"python-stdlib {sys.version_info.major}.{sys.version_info.minor}: "
            f"{len(parts[False]['text'])} train files ({human_bytes(sizes[False])}), "
            f"{len(parts[True]['text'])} validation files ({human_bytes(sizes[True])})"
        )
        return dataset_dict(text_dataset(parts[False]), text_dataset(parts[True]))

    def describe(self) -> str:
        return self._summary or f"python-stdlib: .py files under {self.root}"
