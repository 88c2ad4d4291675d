"""JSON Lines files (or JSON arrays of records) with a text field, one document per record."""

from __future__ import annotations

from llmkit.components.dataset import TableSource
from llmkit.components.dataset.options import JsonlOptions as Options


class JsonLines(TableSource):
    """Local ``.jsonl`` files read with ``datasets.load_dataset("json", ...)``."""

    builder = "json"
    stream_format = "jsonl"
    label = "jsonl"
    Options = Options
