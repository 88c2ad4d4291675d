"""Parquet files with a text column, one document per row."""

from __future__ import annotations

from llmkit.components.dataset import TableSource
from llmkit.components.dataset.options import ParquetOptions as Options


class ParquetFiles(TableSource):
    """Local ``.parquet`` files read with ``datasets.load_dataset("parquet", ...)``."""

    builder = "parquet"
    stream_format = "parquet"
    label = "parquet"
    Options = Options
