"""Local UTF-8 text files: one document per file."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmkit.components.dataset import (
    FileSource,
    dataset_dict,
    human_bytes,
    split_by_hash,
    text_dataset,
)
from llmkit.components.dataset.options import TextOptions as Options
from llmkit.errors import LlmkitError
from llmkit.files import read_utf8

if TYPE_CHECKING:
    import datasets


class TextFiles(FileSource):
    """Text files or globs. ``split="tail"`` holds out the end of every file, ``"file"``
    whole files; ``val_paths`` names the validation files explicitly."""

    Options = Options
    stream_format = "text"

    def splits(self, seed: int) -> datasets.DatasetDict:
        o = self.options
        train_files, val_files = self._files()
        docs = [(str(p), read_utf8(p)) for p in train_files]
        train: list[tuple[str, str]]
        val: list[tuple[str, str]]
        if val_files is not None:
            train, val = docs, [(str(p), read_utf8(p)) for p in val_files]
            how = "val_paths"
        elif o.split == "tail":
            train, val = [], []
            for path, text in docs:
                cut = int(len(text) * (1 - o.val_fraction))  # nanoGPT: data[:int(n*0.9)]
                train.append((path, text[:cut]))
                val.append((path, text[cut:]))
            how = f"last {o.val_fraction:g} of each file"
        else:
            if len(docs) < 2:
                raise LlmkitError(
                    f"data.source: split='file' needs at least 2 files, got {len(docs)}; "
                    "use split='tail' or give val_paths"
                )
            is_val = split_by_hash([p for p, _ in docs], seed, o.val_fraction)
            train = [d for d, v in zip(docs, is_val) if not v]
            val = [d for d, v in zip(docs, is_val) if v]
            how = "by file"
        train = [d for d in train if d[1]]
        val = [d for d in val if d[1]]
        if not train:
            names = ", ".join(str(p) for p in train_files[:3])
            raise LlmkitError(f"data.source: no text in the training files ({names})")
        if not val:
            raise LlmkitError(
                "data.source: the validation split has no text (empty files, or too little "
                "text for val_fraction)"
            )
        size = {k: sum(len(t.encode("utf-8")) for _, t in v) for k, v in (("t", train), ("v", val))}
        n_files = len(train_files) + len(val_files or [])
        self._summary = (
            f"text: {n_files} file(s), {how}: {len(train)} train docs ({human_bytes(size['t'])}), "
            f"{len(val)} validation docs ({human_bytes(size['v'])})"
        )
        return dataset_dict(_to_dataset(train), _to_dataset(val))

    def describe(self) -> str:
        return self._summary or f"text: {', '.join(self.options.paths)}"


def _to_dataset(docs: list[tuple[str, str]]) -> datasets.Dataset:
    return text_dataset({"text": [t for _, t in docs], "path": [p for p, _ in docs]})
