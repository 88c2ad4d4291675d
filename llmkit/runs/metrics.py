"""What a run records: ``metrics.jsonl`` (one JSON object per line) and the loss curve."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from llmkit.errors import LlmkitError, first_line
from llmkit.files import replacing, writing

#: During training the loss curve is redrawn at a checkpoint only if this many seconds passed
#: since the last drawing (a drawing costs ≈ 0.3 s on a 2-core CPU); it is always drawn at
#: the end of the run. The trainer reads it here at each checkpoint.
PLOT_EVERY_S = 30.0


def parse_records(text: str) -> list[dict[str, Any]]:
    """The JSON objects of ``metrics.jsonl`` text, one a line; a line that is not one (cut
    short by a crash, or still being written) is skipped."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def truncate_after(self, step: int) -> None:
        """Drop lines past ``step`` (written after the checkpoint a run resumes from), and any
        line that is not a JSON object; the file is replaced atomically."""
        if not self.path.is_file():
            return
        keep = [line for line in self.read() if line.get("step", 0) <= step]
        with replacing(self.path) as tmp, writing(self.path):
            tmp.write_text("".join(_line(record) for record in keep))

    def read(self) -> list[dict[str, Any]]:
        """Every record; a line that does not parse (a crash can leave the last one half
        written) is skipped."""
        if not self.path.is_file():
            return []
        return parse_records(self.path.read_text(encoding="utf-8", errors="replace"))

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``; a NaN or infinite value is written as null (strict JSON)."""
        with writing(self.path), self.path.open("a") as fh:
            fh.write(_line(record))


class RunLog:
    """``metrics.jsonl`` and the spec's loggers (``train.loggers``) as one: what a run
    writes goes to every one of them. The loggers are built on the first write, on the
    main process only (the others never write), and closed by :meth:`close`."""

    def __init__(
        self,
        metrics: MetricsLog,
        loggers: list[Any] | None = None,
        ctx: Any = None,
    ) -> None:
        self.metrics = metrics
        self._pending = list(loggers or [])  # resolved components, built on first use
        self._ctx = ctx
        self.loggers: list[Any] = []
        self.resume_step: int | None = None

    @classmethod
    def for_run(cls, rs: Any, run_dir: Path) -> RunLog:
        """The log of a run directory with ``rs``'s loggers."""
        from llmkit.runs import METRICS_FILE

        return cls(MetricsLog(run_dir / METRICS_FILE), rs.loggers, (rs, run_dir))

    @property
    def path(self) -> Path:
        return self.metrics.path

    def read(self) -> list[dict[str, Any]]:
        return self.metrics.read()

    def truncate_after(self, step: int) -> None:
        """A resumed run restarts after ``step``: ``metrics.jsonl`` drops later lines and
        the loggers are built knowing it (``LoggerContext.resume_step``)."""
        self.metrics.truncate_after(step)
        self.resume_step = step

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        self.open()
        for logger in self.loggers:
            logger.log(dict(record))

    def open(self) -> None:
        """Build the loggers not built yet (the first write does it too)."""
        if not self._pending:
            return
        from llmkit.contracts import LoggerContext

        rs, run_dir = self._ctx
        ctx = LoggerContext(
            run_dir=run_dir,
            run_name=rs.spec.name or run_dir.name,
            config=dict(rs.raw),
            resume_step=self.resume_step,
        )
        pending, self._pending = self._pending, []
        for res in pending:
            try:
                self.loggers.append(res.build(res.options, ctx))
            except LlmkitError:
                raise
            except Exception as exc:  # a tracker's own error: one line naming the logger
                raise LlmkitError(
                    f"logger {res.name} could not start: {first_line(exc, typed=True)}"
                ) from exc

    def close(self) -> None:
        """Close every logger built (once); the first error is raised after all closed."""
        loggers, self.loggers = self.loggers, []
        first: BaseException | None = None
        for logger in loggers:
            try:
                logger.close()
            except Exception as exc:  # close the others first
                first = first or exc
        if first is not None:
            raise first


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _line(record: dict[str, Any]) -> str:
    return json.dumps({k: _finite(v) for k, v in record.items()}, allow_nan=False) + "\n"


def _points(records: list[dict[str, Any]], key: str) -> list[tuple[Any, float]]:
    return [
        (r["step"], r[key])
        for r in records
        if isinstance(r.get(key), int | float) and math.isfinite(r[key])
    ]


def plot_losses(records: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """The loss curve (train, and validation where evaluated) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = _points(records, "loss")
    val = _points(records, "val_loss")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with replacing(path, ".png") as tmp:
        fig.savefig(tmp)
    plt.close(fig)
