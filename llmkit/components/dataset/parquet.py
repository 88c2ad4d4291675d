"""Parquet files with a text column, one document per row."""

from __future__ import annotations

from llmkit.components.dataset import TableSource, TableSourceOptions


class Options(TableSourceOptions):
    """Options of the parquet source."""


class ParquetFiles(TableSource):
    """Local ``.parquet`` files read with ``datasets.load_dataset("parquet", ...)``."""

    builder = "parquet"
    label = "parquet"
    Options = Options
