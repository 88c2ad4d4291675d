"""Scaling-law data: (N, D, C, loss) points from runs, sweeps and CSV files."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmkit.errors import LlmkitError

#: FLOPs per parameter per token when the points carry no FLOP count (Kaplan et al.: C ≈ 6ND).
SIX = 6.0
RESULTS_FILES = ("results.jsonl", "results.csv")


# -- points ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One trained model: N non-embedding parameters, D training tokens, C training FLOPs
    (None when unknown: 6ND is assumed where a FLOP count is needed), its final loss, where it
    came from, and optionally the nominal compute budget of its IsoFLOP group."""

    N: float
    D: float
    C: float | None
    loss: float
    source: str = ""
    budget: float | None = None

    @property
    def flops(self) -> float:
        """C, or 6ND when the point carries no FLOP count."""
        return self.C if self.C is not None else SIX * self.N * self.D

    def as_dict(self) -> dict[str, Any]:
        out = {"N": self.N, "D": self.D, "C": self.C, "loss": self.loss, "source": self.source}
        if self.budget is not None:
            out["budget"] = self.budget
        return out


def _number(value: Any, what: str, where: str, *, optional: bool = False) -> float | None:
    """``value`` as a finite number > 0 (None for a missing optional one)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        if optional:
            return None
        raise LlmkitError(f"{where}: no {what}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise LlmkitError(f"{where}: {what} is not a number: {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise LlmkitError(f"{where}: {what} must be a finite number > 0, got {value!r}")
    return number


def make_point(
    N: Any,
    D: Any,
    loss: Any,
    C: Any = None,
    *,
    source: str = "",
    budget: Any = None,
) -> Point:
    """A checked :class:`Point`: every value finite and > 0 (C and budget may be None)."""
    where = source or "point"
    return Point(
        N=_number(N, "N (non-embedding parameters)", where),  # type: ignore[arg-type]
        D=_number(D, "D (training tokens)", where),  # type: ignore[arg-type]
        C=_number(C, "C (training FLOPs)", where, optional=True),
        loss=_number(loss, "loss", where),  # type: ignore[arg-type]
        source=source,
        budget=_number(budget, "budget", where, optional=True),
    )


#: Column names (lower case) a points table may use, per field.
COLUMNS = {
    "N": ("n", "non_embedding_params"),  # never a sweep's "params": those count embeddings
    "D": ("d", "tokens"),
    "loss": ("loss", "final_val_ce", "final_val_loss", "val_loss"),
    "C": ("c", "flops"),
    "source": ("source", "label", "trial", "name"),
    "budget": ("budget",),
}


def _row_point(row: dict[str, Any], where: str, default_label: str) -> Point | None:
    """The point of one table row (keys matched case-insensitively against :data:`COLUMNS`);
    None for a row whose ``status`` is present and not ``done``."""
    lower = {str(k).strip().lower(): v for k, v in row.items() if k is not None}
    status = lower.get("status")
    if status is not None and str(status).strip().lower() != "done":
        return None

    def get(name: str) -> Any:
        return next((lower[c] for c in COLUMNS[name] if c in lower), None)

    label = get("source")
    label = default_label if label is None or str(label) == "" else str(label)
    missing = [n for n in ("N", "D", "loss") if get(n) is None]
    if missing:
        names = " / ".join(COLUMNS[missing[0]])
        raise LlmkitError(f"{where}: no column {names!r} (expected N, D, loss and optional C)")
    return make_point(get("N"), get("D"), get("loss"), get("C"), source=label, budget=get("budget"))


def _table_rows(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) of each row of a CSV (header first) or JSONL file."""
    text = read_text(p)
    if p.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines())
        if not reader.fieldnames:
            raise LlmkitError(f"{p}: empty CSV (expected a header: N, D, loss[, C])")
        for i, row in enumerate(reader, start=2):
            yield f"{p}:{i}", row
        return
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise LlmkitError(f"{p}:{i}: not a JSON object")
        yield f"{p}:{i}", row


def points_from_csv(path: str | Path) -> list[Point]:
    """Points from a CSV table with columns N, D, loss and optionally C (training FLOPs),
    source and budget; a sweep's ``results.csv`` works too (its columns
    ``non_embedding_params``, ``tokens``, ``flops``, ``final_val_loss``, ``trial``; rows whose
    ``status`` is not ``done`` are left out)."""
    p = Path(path)
    if p.suffix.lower() != ".csv" and p.is_file():
        raise LlmkitError(f"{p}: expected a .csv file")
    points = [
        point
        for where, row in _table_rows(p)
        if (point := _row_point(row, where, where.rpartition("/")[2])) is not None
    ]
    if not points:
        raise LlmkitError(f"{p}: no points (no rows, or no row with status 'done')")
    return points


def points_from_sweep(path: str | Path) -> list[Point]:
    """The finished trials (``status`` "done") of a sweep: its directory (holding
    ``results.jsonl`` or ``results.csv``) or either file. Each row gives
    ``non_embedding_params`` (N), ``tokens`` (D), ``flops`` (C), ``final_val_loss`` and
    ``trial``, labelled ``SWEEP/TRIAL`` (SWEEP: the directory's name)."""
    p = Path(path)
    if p.is_dir():
        found = [p / name for name in RESULTS_FILES if (p / name).is_file()]
        if not found:
            raise LlmkitError(f"{p}: not a sweep directory (no {' or '.join(RESULTS_FILES)})")
        p = found[0]
    name = p.resolve().parent.name
    points = []
    for where, row in _table_rows(p):
        trial = row.get("trial")
        if trial is not None and str(trial) != "":
            row = {**row, "trial": f"{name}/{trial}"}
        point = _row_point(row, where, f"{name}/{where.rpartition(':')[2]}")
        if point is not None:
            points.append(point)
    if not points:
        raise LlmkitError(f"{p}: no finished trials (status 'done')")
    return points


def read_text(p: Path) -> str:
    if not p.exists():
        raise LlmkitError(f"file not found: {p}")
    if p.is_dir():
        raise LlmkitError(f"{p} is a directory; expected a file")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmkitError(f"cannot read {p}: {exc}") from exc


def _metrics(path: Path) -> list[dict[str, Any]]:
    """Every JSON object line of a run's ``metrics.jsonl`` (a half-written line is skipped)."""
    records = []
    for line in read_text(path).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int | float):
            records.append(record)
    return records


def _tokens_at(step: float, train: list[tuple[float, float]], where: str) -> float:
    """Tokens trained by ``step`` from the logged (step, cumulative tokens) pairs: exact at a
    logged step, else interpolated between the neighbouring lines, else extrapolated at the
    last logged line's tokens per step."""
    before = [(s, t) for s, t in train if s <= step]
    after = [(s, t) for s, t in train if s > step]
    if before and before[-1][0] == step:
        return before[-1][1]
    if before and after:
        (s0, t0), (s1, t1) = before[-1], after[0]
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    s0, t0 = before[-1] if before else after[0]
    if s0 <= 0:
        raise LlmkitError(f"{where}: cannot tell the tokens trained by step {step:g}")
    return t0 * step / s0


def points_from_runs(paths: Iterable[str | Path], *, all_evals: bool = False) -> list[Point]:
    """One point per llmkit run directory: its final validation loss (``val_ce`` where the
    objective is not plain cross-entropy), the tokens trained by that evaluation, N its
    non-embedding parameters and C = training FLOPs per token × D, both from the model built
    on the meta device (no memory).

    ``all_evals=True`` gives one point per evaluation instead. Only meaningful for runs whose
    every evaluation follows a learning-rate cooldown (e.g. WSD with decay branches): a
    mid-run evaluation of a cosine run is not the loss that run length would reach, and mixing
    such points biases the fit toward more tokens.
    """
    from llmkit.model import build_on_meta
    from llmkit.runs import METRICS_FILE, open_run

    points = []
    for path in paths:
        run = open_run(path)
        rs = run.resolve()
        model = build_on_meta(rs)
        n = model.num_params(exclude_embeddings=True)
        block = rs.spec.data.block_size or rs.model.max_seq_len
        per_token = float(model.flops_per_token(block)["train"])
        records = _metrics(run.dir / METRICS_FILE)
        train = {r["step"]: float(r["tokens"]) for r in records if "tokens" in r}
        steps = sorted(train.items())
        evals = [r for r in records if "val_loss" in r]
        where = str(run.dir)
        if not evals or not steps:
            raise LlmkitError(f"{where}: no validation loss in {METRICS_FILE} (not trained?)")
        chosen = evals if all_evals else evals[-1:]
        for record in chosen:
            value = record.get("val_ce", record["val_loss"])
            finite = isinstance(value, int | float) and math.isfinite(value)
            if not finite:
                if all_evals:
                    continue
                raise LlmkitError(
                    f"{where}: the last validation loss (step {record['step']}) is not finite "
                    "(the run diverged?); leave the run out"
                )
            tokens = _tokens_at(float(record["step"]), steps, where)
            label = f"{where}@{record['step']}" if all_evals else where
            points.append(make_point(n, tokens, value, per_token * tokens, source=label))
    return points


def points_from_sources(paths: Iterable[str | Path], *, all_evals: bool = False) -> list[Point]:
    """Points from each path by what it is: a run directory, a directory of run
    directories, a sweep directory or its ``results.jsonl``/``results.csv``, or a CSV of
    points (N, D, loss[, C])."""
    from llmkit.runs import SPEC_FILE

    points: list[Point] = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise LlmkitError(f"not found: {p}")
        if p.is_dir():
            if (p / SPEC_FILE).is_file():
                points += points_from_runs([p], all_evals=all_evals)
            elif any((p / name).is_file() for name in RESULTS_FILES):
                points += points_from_sweep(p)
            else:
                runs = sorted(c for c in p.iterdir() if (c / SPEC_FILE).is_file())
                if not runs:
                    raise LlmkitError(
                        f"{p}: not a run directory ({SPEC_FILE}), a sweep directory "
                        f"({' or '.join(RESULTS_FILES)}) or a directory of runs"
                    )
                points += points_from_runs(runs, all_evals=all_evals)
        elif p.suffix.lower() == ".jsonl":
            points += points_from_sweep(p)
        elif p.suffix.lower() == ".csv":
            points += points_from_csv(p)
        else:
            raise LlmkitError(f"{p}: expected a run or sweep directory, a .jsonl or a .csv")
    return points


def check_points(points: Sequence[Point], *, what: str = "the L(N, D) fit") -> list[Point]:
    """``points`` if they can determine the five parameters: at least 5 distinct (N, D), at
    least 2 distinct N and 2 distinct D, every value finite and > 0."""
    pts = [make_point(p.N, p.D, p.loss, p.C, source=p.source, budget=p.budget) for p in points]
    pairs = {(p.N, p.D) for p in pts}
    ns, ds = {p.N for p in pts}, {p.D for p in pts}
    if len(pairs) < 5 or len(ns) < 2 or len(ds) < 2:
        raise LlmkitError(
            f"{what} needs at least 5 points at distinct (N, D), with at least 2 model sizes "
            f"and 2 token counts; got {len(pairs)} distinct (N, D), {len(ns)} sizes, "
            f"{len(ds)} token counts"
        )
    return pts
