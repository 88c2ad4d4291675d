"""``csv``: the run's records as a CSV table, one row per record, one column per key."""

from __future__ import annotations

import csv
import math
from typing import Any

from llmkit.components.logger.options import CsvOptions as Options
from llmkit.contracts import LoggerContext, MetricsLogger
from llmkit.files import replacing


class CsvLogger(MetricsLogger):
    """Rows in record order; a key first seen later adds a column (the file is rewritten
    with the wider header, earlier rows empty there). A resumed run drops the rows after
    the step it restarts from."""

    Options = Options

    def __init__(self, options: Options, ctx: LoggerContext) -> None:
        self.path = ctx.run_dir / options.file
        self.columns: list[str] = ["step"]
        self.rows: list[dict[str, Any]] = []
        if self.path.is_file():
            with self.path.open(newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = list(reader)
            if ctx.resume_step is not None:
                self.rows = [r for r in self.rows if _step(r) <= ctx.resume_step]
            self._rewrite()

    def log(self, record: dict[str, Any]) -> None:
        row = {k: _cell(v) for k, v in record.items()}
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new:
            self.columns += new
            self._rewrite()
            return
        with self.path.open("a", newline="", encoding="utf-8") as fh:
            csv.DictWriter(fh, self.columns).writerow(row)

    def _rewrite(self) -> None:
        with replacing(self.path) as tmp, tmp.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, self.columns)
            writer.writeheader()
            writer.writerows(self.rows)


def _step(row: dict[str, Any]) -> int:
    try:
        return int(row.get("step") or 0)
    except ValueError:
        return 0


def _cell(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    return value
