"""JSON Lines files (or JSON arrays of records) with a text field, one document per record."""

from __future__ import annotations

from llmkit.components.dataset import TableSource, TableSourceOptions


class Options(TableSourceOptions):
    """Options of the jsonl source."""


class JsonLines(TableSource):
    """Local ``.jsonl`` files read with ``datasets.load_dataset("json", ...)``."""

    builder = "json"
    label = "jsonl"
    Options = Options
