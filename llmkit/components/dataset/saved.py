"""A dataset directory written by ``datasets``' ``save_to_disk`` (a Dataset or DatasetDict)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmkit.components.dataset import (
    VALIDATION_NAMES,
    dataset_dict,
    files_fingerprint,
    seeded_split,
    select_text,
)
from llmkit.components.dataset.options import SavedOptions as Options
from llmkit.errors import LlmkitError

if TYPE_CHECKING:
    import datasets


class SavedDataset:
    """``datasets.load_from_disk(path)``: a DatasetDict's ``train`` split (or its only split)
    and its validation split, or a seeded share of the rows if it has none."""

    Options = Options

    def __init__(self, options: Options) -> None:
        self.options = options
        self._summary: str | None = None

    @property
    def dir(self) -> Path:
        return Path(self.options.path).expanduser()

    def fingerprint(self) -> str:
        if not self.options.path or not self.dir.is_dir():
            return ""
        files = sorted(
            p for p in self.dir.rglob("*") if p.is_file() and not p.name.startswith("cache-")
        )
        return files_fingerprint(files)

    def _load(self) -> datasets.Dataset | datasets.DatasetDict:
        import datasets

        if not self.options.path:
            raise LlmkitError("data.source.path: name the directory written by save_to_disk")
        if not self.dir.is_dir():
            raise LlmkitError(f"data.source.path: directory not found: {self.options.path}")
        try:
            return datasets.load_from_disk(str(self.dir))
        except Exception as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise LlmkitError(
                f"{self.dir}: not a directory written by save_to_disk ({first})"
            ) from exc

    def splits(self, seed: int) -> datasets.DatasetDict:
        import datasets

        o = self.options
        loaded = self._load()
        where = f"saved dataset {self.dir}"
        if isinstance(loaded, datasets.DatasetDict):
            names = list(loaded)
            val_name = next((n for n in VALIDATION_NAMES if n in loaded), None)
            rest = [n for n in names if n != val_name]
            if "train" in loaded:
                train_name = "train"
            elif len(rest) == 1:
                train_name = rest[0]
            else:
                raise LlmkitError(
                    f"{where}: no 'train' split (splits: {', '.join(names) or 'none'})"
                )
            train = select_text(loaded[train_name], o.text_field, f"{where} [{train_name}]")
            if val_name is None:
                parts = seeded_split(train, o.val_fraction, seed, where)
                how = f"{train_name} split {1 - o.val_fraction:g}/{o.val_fraction:g}"
            else:
                val = select_text(loaded[val_name], o.text_field, f"{where} [{val_name}]")
                parts = dataset_dict(train, val)
                how = f"splits {train_name!r} and {val_name!r}"
        else:
            train = select_text(loaded, o.text_field, where)
            parts = seeded_split(train, o.val_fraction, seed, where)
            how = f"split {1 - o.val_fraction:g}/{o.val_fraction:g}"
        for name, ds in parts.items():
            if len(ds) == 0:
                raise LlmkitError(f"{where}: the {name} split has no documents")
        self._summary = (
            f"saved {self.dir.name}: {how}: {len(parts['train'])} train docs, "
            f"{len(parts['validation'])} validation docs"
        )
        return parts

    def describe(self) -> str:
        return self._summary or f"saved: {self.options.path}"
