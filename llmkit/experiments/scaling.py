"""Scaling laws: fit L(N, D) = E + A/N^α + B/D^β to runs, find IsoFLOP minima, and plan
the compute-optimal model size and token count for a FLOP budget.

Two of the three methods of Hoffmann et al. 2022, "Training Compute-Optimal Large Language
Models" (Chinchilla), arXiv:2203.15556:

* approach 3 (:func:`fit_loss_law`): fit the five parameters of L(N, D) to every (N, D, loss)
  point by minimising a Huber loss (δ = 10⁻³) on log-loss with L-BFGS from a grid of
  initialisations; the compute-optimal frontier is then closed form (their eq. 4,
  :func:`compute_optimal`);
* approach 2 (:func:`isoflop_minima`): group runs of equal compute, fit a parabola of loss
  against log N in each group, and fit power laws N_opt ∝ C^a, D_opt ∝ C^b to the minima.

Uncertainty comes from refitting on bootstrap resamples of the points (:func:`bootstrap`), as
Besiroglu et al. 2024, "Chinchilla Scaling: A replication attempt" (arXiv:2404.10102), did
when they refitted approach 3 and found the original intervals implausibly narrow.

Here N counts non-embedding parameters (Kaplan et al. 2020, arXiv:2001.08361; what
``llmkit info`` reports as non-embedding), D the training tokens, and C the training FLOPs by
the model's own accounting (``Transformer.flops_per_token()["train"]`` × D), not 6ND.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import math
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.errors import LlmkitError

#: Hoffmann et al.'s Huber δ on log-loss residuals.
HUBER_DELTA = 1e-3
#: Hoffmann et al.'s initialisation grid, as (a, b, e, α, β) with A = eᵃ, B = eᵇ, E = eᵉ:
#: a, b ∈ {0, 5, …, 25}, e ∈ {−1, −0.5, …, 1}, α, β ∈ {0, 0.5, …, 2} (4,500 points).
GRID_AXES = (
    (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    (-1.0, -0.5, 0.0, 0.5, 1.0),
    (0.0, 0.5, 1.0, 1.5, 2.0),
    (0.0, 0.5, 1.0, 1.5, 2.0),
)
#: L-BFGS runs start from the grid points with the lowest objective (all of them: ``None``).
#: On synthetic Chinchilla-like data the lowest grid point alone already reaches the best
#: minimum of all 4,500 starts; 16 leaves a wide margin at 0.3 % of the cost.
DEFAULT_STARTS = 16
#: FLOPs per parameter per token when the points carry no FLOP count (Kaplan et al.: C ≈ 6ND).
SIX = 6.0
PARAMS = ("E", "A", "B", "alpha", "beta")
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
    "loss": ("loss", "final_val_loss", "val_loss"),
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
    text = _read_text(p)
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


def _read_text(p: Path) -> str:
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
    for line in _read_text(path).splitlines():
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
    import torch

    from llmkit.model import build_model
    from llmkit.runs import METRICS_FILE, open_run

    points = []
    for path in paths:
        run = open_run(path)
        rs = run.resolve()
        with torch.device("meta"):
            model = build_model(rs)
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


# -- approach 3: the parametric fit ---------------------------------------------------------------


@dataclass
class LawFit:
    """L(N, D) = E + A/N^α + B/D^β fitted to ``points`` (Hoffmann et al. approach 3).

    ``objective`` is Σ Huber_δ(r)/δ over the log-loss residuals r at the optimum; ``k`` the
    geometric mean of the points' C/(N·D), the FLOPs per parameter per token of the model's
    own accounting (None when no point carries C); ``optima`` the distinct local minima found
    as (a, b, e, α, β), best first (the starts of bootstrap refits)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float
    huber_delta: float
    points: list[Point]
    k: float | None = None
    optima: list[list[float]] = field(default_factory=list)
    starts: int = 0

    @property
    def theta(self) -> np.ndarray:
        """(a, b, e, α, β): the parameters L-BFGS works in."""
        return np.array(
            [math.log(self.A), math.log(self.B), math.log(self.E), self.alpha, self.beta]
        )

    @property
    def a(self) -> float:
        """The exponent of N_opt ∝ C^a: β/(α+β)."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """The exponent of D_opt ∝ C^b: α/(α+β)."""
        return self.alpha / (self.alpha + self.beta)

    def params(self) -> dict[str, float]:
        return {p: getattr(self, p) for p in PARAMS}

    def predict(self, N: Any, D: Any) -> np.ndarray:
        """The fitted loss at N non-embedding parameters and D tokens (arrays broadcast)."""
        N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
        return self.E + self.A / N**self.alpha + self.B / D**self.beta

    def rms_log_residual(self) -> float:
        """Root mean square of log(predicted) − log(observed) over the points."""
        n = np.array([p.N for p in self.points])
        d = np.array([p.D for p in self.points])
        loss = np.array([p.loss for p in self.points])
        return float(np.sqrt(np.mean((np.log(self.predict(n, d)) - np.log(loss)) ** 2)))

    @property
    def flops_per_param_token(self) -> float:
        """k of C = k·N·D: the points' own (:attr:`k`), else 6."""
        return self.k if self.k is not None else SIX

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.params(),
            "a": self.a,
            "b": self.b,
            "objective": self.objective,
            "huber_delta": self.huber_delta,
            "k": self.k,
            "rms_log_residual": self.rms_log_residual(),
            "optima": self.optima,
            "starts": self.starts,
        }

    @classmethod
    def from_dict(cls, law: dict[str, Any], points: list[Point]) -> LawFit:
        return cls(
            **{p: float(law[p]) for p in PARAMS},
            objective=float(law.get("objective", math.nan)),
            huber_delta=float(law.get("huber_delta", HUBER_DELTA)),
            points=points,
            k=law.get("k"),
            optima=[list(map(float, o)) for o in law.get("optima", [])],
            starts=int(law.get("starts", 0)),
        )


def _objective(
    theta: np.ndarray, x_n: np.ndarray, x_d: np.ndarray, y: np.ndarray, delta: float
) -> tuple[float, np.ndarray]:
    """Σ Huber_δ(LSE(a − α·x_n, b − β·x_d, e) − y)/δ and its gradient in (a, b, e, α, β).

    Divided by δ (the same minimiser): the sum is then ≈ Σ|r|, of order 0.1–1 rather than
    10⁻⁴, so L-BFGS's relative-reduction stopping test does not end the search early."""
    a, b, e, alpha, beta = theta
    t1 = a - alpha * x_n
    t2 = b - beta * x_d
    m = np.maximum(np.maximum(t1, t2), e)
    w1, w2, w3 = np.exp(t1 - m), np.exp(t2 - m), np.exp(e - m)
    s = w1 + w2 + w3
    r = m + np.log(s) - y
    ar = np.abs(r)
    value = np.where(ar <= delta, 0.5 * r * r, delta * (ar - 0.5 * delta)).sum() / delta
    g = np.clip(r, -delta, delta) / (delta * s)
    g1, g2 = g * w1, g * w2
    grad = np.array([g1.sum(), g2.sum(), (g * w3).sum(), -(g1 @ x_n), -(g2 @ x_d)])
    return float(value), grad


def _objective_many(
    thetas: np.ndarray, x_n: np.ndarray, x_d: np.ndarray, y: np.ndarray, delta: float
) -> np.ndarray:
    """The objective of :func:`_objective` at each row of ``thetas`` (no gradient)."""
    a, b, e, alpha, beta = (thetas[:, i : i + 1] for i in range(5))
    lse = np.logaddexp(np.logaddexp(a - alpha * x_n, b - beta * x_d), e)
    ar = np.abs(lse - y)
    return np.where(ar <= delta, 0.5 * ar * ar, delta * (ar - 0.5 * delta)).sum(axis=1) / delta


@contextlib.contextmanager
def _one_blas_thread() -> Iterator[None]:
    """One BLAS thread while L-BFGS runs: its tiny matrix products are several times slower
    threaded (measured: 13 ms against 50–500 ms per fit on a busy 2-core machine). Uses
    threadpoolctl where installed; otherwise a no-op."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _minimize() -> Any:
    try:
        from scipy.optimize import minimize
    except ImportError:
        raise LlmkitError("scaling-law fits need scipy: pip install scipy") from None
    return minimize


def _fit_theta(
    starts: np.ndarray, data: tuple[np.ndarray, np.ndarray, np.ndarray], delta: float
) -> list[tuple[float, np.ndarray]]:
    """(objective, θ) of an L-BFGS run from each start, best first (non-finite ones dropped)."""
    minimize = _minimize()
    results = []
    with _one_blas_thread(), np.errstate(over="ignore", invalid="ignore"):
        for start in starts:
            res = minimize(
                _objective,
                np.asarray(start, dtype=float),
                args=(*data, delta),
                jac=True,
                method="L-BFGS-B",
                options={"maxiter": 2000, "ftol": 1e-13, "gtol": 1e-9},
            )
            if math.isfinite(res.fun) and np.all(np.isfinite(res.x)):
                results.append((float(res.fun), res.x))
    results.sort(key=lambda r: r[0])
    return results


def _grid(inits: str | Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
    if isinstance(inits, str):
        if inits != "grid":
            raise LlmkitError(f"inits: expected 'grid' or an array of (a, b, e, α, β); {inits!r}")
        return np.array(list(itertools.product(*GRID_AXES)), dtype=float)
    grid = np.asarray(inits, dtype=float)
    if grid.ndim != 2 or grid.shape[1] != 5 or not np.all(np.isfinite(grid)) or not len(grid):
        raise LlmkitError("inits: expected rows of five finite numbers (a, b, e, α, β)")
    return grid


def _log_data(points: Sequence[Point]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.log([p.N for p in points]),
        np.log([p.D for p in points]),
        np.log([p.loss for p in points]),
    )


def _flops_ratio(points: Sequence[Point]) -> float | None:
    """Geometric mean of C/(N·D) over the points carrying C."""
    ratios = [p.C / (p.N * p.D) for p in points if p.C is not None]
    return float(np.exp(np.mean(np.log(ratios)))) if ratios else None


def _distinct(results: list[tuple[float, np.ndarray]], keep: int = 5) -> list[list[float]]:
    """Up to ``keep`` distinct optima (θ differing by > 10⁻³ relative), best first."""
    out: list[np.ndarray] = []
    for _, x in results:
        if not any(np.allclose(x, o, rtol=1e-3, atol=1e-6) for o in out):
            out.append(x)
        if len(out) == keep:
            break
    return [o.tolist() for o in out]


def fit_loss_law(
    points: Sequence[Point],
    *,
    huber_delta: float = HUBER_DELTA,
    inits: str | Sequence[Sequence[float]] | np.ndarray = "grid",
    starts: int | None = DEFAULT_STARTS,
) -> LawFit:
    """Fit L(N, D) = E + A/N^α + B/D^β, Hoffmann et al. 2022's approach 3.

    Minimises Σᵢ Huber_δ(LSE(a − α log Nᵢ, b − β log Dᵢ, e) − log Lᵢ) over (a, b, e, α, β)
    with L-BFGS (scipy), A = eᵃ, B = eᵇ, E = eᵉ, δ = 10⁻³ as in the paper. ``inits`` is the
    paper's grid of initialisations (:data:`GRID_AXES`) or an array of (a, b, e, α, β) rows;
    every one is scored and L-BFGS starts from the ``starts`` best (``None``: from all, as
    the paper; minutes rather than a second). The lowest minimum is kept.
    """
    pts = check_points(points)
    if not (math.isfinite(huber_delta) and huber_delta > 0):
        raise LlmkitError(f"huber_delta must be > 0, got {huber_delta}")
    data = _log_data(pts)
    grid = _grid(inits)
    with np.errstate(over="ignore", invalid="ignore"):
        scores = _objective_many(grid, *data, huber_delta)
    order = np.argsort(np.where(np.isfinite(scores), scores, np.inf), kind="stable")
    chosen = grid[order[: starts or len(order)]]
    results = _fit_theta(chosen, data, huber_delta)
    if not results:
        raise LlmkitError("the L(N, D) fit failed from every initialisation")
    value, (a, b, e, alpha, beta) = results[0]
    return LawFit(
        E=math.exp(e),
        A=math.exp(a),
        B=math.exp(b),
        alpha=float(alpha),
        beta=float(beta),
        objective=value,
        huber_delta=huber_delta,
        points=pts,
        k=_flops_ratio(pts),
        optima=_distinct(results),
        starts=len(chosen),
    )


# -- bootstrap ------------------------------------------------------------------------------------


def _derived(samples: np.ndarray) -> dict[str, np.ndarray]:
    """Parameters and the frontier exponents of (E, A, B, α, β) rows."""
    out = {name: samples[:, i] for i, name in enumerate(PARAMS)}
    with np.errstate(divide="ignore", invalid="ignore"):
        out["a"] = out["beta"] / (out["alpha"] + out["beta"])
        out["b"] = out["alpha"] / (out["alpha"] + out["beta"])
    return out


def _interval(values: np.ndarray, level: float) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if not len(values):
        return (math.nan, math.nan)
    tail = 50 * (1 - level)
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return (float(lo), float(hi))


@dataclass
class Bootstrap:
    """Refits of L(N, D) on resamples of the points: ``samples`` rows (E, A, B, α, β)."""

    samples: np.ndarray
    requested: int
    failed: int
    seed: int

    def intervals(self, level: float = 0.95) -> dict[str, tuple[float, float]]:
        """Percentile intervals (2.5–97.5 % at 0.95) of E, A, B, α, β, a = β/(α+β) and
        b = α/(α+β)."""
        return {k: _interval(v, level) for k, v in _derived(self.samples).items()}

    def as_dict(self) -> dict[str, Any]:
        return {
            "n": len(self.samples),
            "requested": self.requested,
            "failed": self.failed,
            "seed": self.seed,
            "columns": list(PARAMS),
            "samples": self.samples.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Bootstrap:
        samples = np.asarray(data["samples"], dtype=float).reshape(-1, 5)
        return cls(samples, int(data["requested"]), int(data["failed"]), int(data["seed"]))


def bootstrap(
    points: Sequence[Point],
    n: int = 200,
    *,
    seed: int = 0,
    fit: LawFit | None = None,
) -> Bootstrap:
    """Refit L(N, D) on ``n`` resamples of the points (drawn with replacement). Each refit
    starts from the full fit's distinct optima. A resample that cannot determine the law
    (fewer than 5 distinct (N, D), 2 sizes or 2 token counts) or whose refit fails is drawn
    again, up to 2n draws in all; ``failed`` counts them."""
    if n < 1:
        raise LlmkitError(f"bootstrap: n must be ≥ 1, got {n}")
    pts = check_points(points)
    if fit is None:
        fit = fit_loss_law(pts)
    starts = np.array(fit.optima[:3] or [fit.theta.tolist()])
    rng = np.random.default_rng(seed)
    data = _log_data(pts)
    samples: list[list[float]] = []
    draws = 0
    while len(samples) < n and draws < 2 * n:
        draws += 1
        idx = rng.integers(0, len(pts), len(pts))
        x_n, x_d = data[0][idx], data[1][idx]
        if len(set(zip(x_n, x_d, strict=True))) < 5 or len(set(x_n)) < 2 or len(set(x_d)) < 2:
            continue
        results = _fit_theta(starts, (x_n, x_d, data[2][idx]), fit.huber_delta)
        if results:
            a, b, e, alpha, beta = results[0][1]
            samples.append([math.exp(e), math.exp(a), math.exp(b), alpha, beta])
    if not samples:
        raise LlmkitError("bootstrap: no resample could be fitted (too few distinct points)")
    return Bootstrap(np.array(samples), n, draws - len(samples), seed)


# -- the compute-optimal frontier -----------------------------------------------------------------


def _frontier(
    params: np.ndarray, flops: float, k: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(N_opt, D_opt, L_opt) of (E, A, B, α, β) rows under C = k·N·D (Hoffmann et al. eq. 4)."""
    E, A, B, alpha, beta = (params[:, i] for i in range(5))
    with np.errstate(all="ignore"):
        G = (alpha * A / (beta * B)) ** (1 / (alpha + beta))
        n_opt = G * (flops / k) ** (beta / (alpha + beta))
        d_opt = (flops / k) / n_opt
        loss = E + A / n_opt**alpha + B / d_opt**beta
    return n_opt, d_opt, loss


@dataclass
class Plan:
    """The compute-optimal N and D for ``flops`` under C = k·N·D, the loss the law predicts
    there, and percentile intervals from bootstrap refits (empty without them)."""

    flops: float
    k: float
    N: float
    D: float
    loss: float
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    level: float = 0.95

    @property
    def tokens_per_param(self) -> float:
        return self.D / self.N

    def as_dict(self) -> dict[str, Any]:
        return {
            "flops": self.flops,
            "k": self.k,
            "N": self.N,
            "D": self.D,
            "loss": self.loss,
            "tokens_per_param": self.tokens_per_param,
            "level": self.level,
            "intervals": {k: list(v) for k, v in self.intervals.items()},
        }


def compute_optimal(
    fit: LawFit,
    flops: float,
    *,
    k: float | None = None,
    boot: Bootstrap | None = None,
    level: float = 0.95,
) -> Plan:
    """Minimise L(N, D) subject to C = k·N·D: Hoffmann et al.'s eq. 4,
    N_opt = G·(C/k)^{β/(α+β)}, D_opt = G⁻¹·(C/k)^{α/(α+β)}, G = (αA/(βB))^{1/(α+β)}.

    ``k`` defaults to the fit's points' own C/(N·D) (the model's FLOP accounting at the
    sizes fitted), else 6. With ``boot``, each refit gives its own optimum: their percentile
    intervals of N, D, the predicted loss and D/N."""
    if not (isinstance(flops, int | float) and math.isfinite(flops) and flops > 0):
        raise LlmkitError(f"flops must be a finite number > 0, got {flops}")
    k = fit.flops_per_param_token if k is None else k
    if not (math.isfinite(k) and k > 0):
        raise LlmkitError(f"k (FLOPs per parameter per token) must be > 0, got {k}")
    if fit.alpha <= 0 or fit.beta <= 0:
        raise LlmkitError(
            f"the fit has α = {fit.alpha:.3g}, β = {fit.beta:.3g}: loss does not fall with both "
            "N and D over these points, so there is no compute-optimal trade-off"
        )
    n, d, loss = (float(v[0]) for v in _frontier(np.array([list(fit.params().values())]), flops, k))
    intervals = {}
    usable = None if boot is None else boot.samples[(boot.samples[:, 3:] > 0).all(axis=1)]
    if usable is not None and len(usable):  # a refit with α or β ≤ 0 has no optimum
        ns, ds, losses = _frontier(usable, flops, k)
        intervals = {
            "N": _interval(ns, level),
            "D": _interval(ds, level),
            "loss": _interval(losses, level),
            "tokens_per_param": _interval(ds / ns, level),
        }
    return Plan(flops, k, n, d, loss, intervals, level)


# -- approach 2: IsoFLOP minima -------------------------------------------------------------------


@dataclass
class IsoGroup:
    """One IsoFLOP group: its budget C (geometric mean of its points' C), the parabola
    loss = c₂x² + c₁x + c₀ in x = ln N, and its minimum."""

    flops: float
    points: list[Point]
    coef: tuple[float, float, float]
    N: float
    D: float
    loss: float
    k: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "flops": self.flops,
            "N_opt": self.N,
            "D_opt": self.D,
            "loss_opt": self.loss,
            "k": self.k,
            "parabola": list(self.coef),
            "sizes": sorted({p.N for p in self.points}),
            "points": [p.as_dict() for p in self.points],
        }


@dataclass
class IsoFlopFit:
    """Approach 2: the minima of each IsoFLOP group and the power laws fitted to them,
    N_opt = n₀·C^a and D_opt = d₀·C^b (least squares in log–log); ``skipped`` groups are
    (budget, why); ``samples`` rows (a, ln n₀, b, ln d₀) from resampling points within
    groups."""

    groups: list[IsoGroup]
    a: float
    log_n0: float
    b: float
    log_d0: float
    skipped: list[tuple[float, str]] = field(default_factory=list)
    samples: np.ndarray | None = None

    def predict(self, flops: float) -> tuple[float, float]:
        """(N_opt, D_opt) at ``flops`` from the power laws."""
        lc = math.log(flops)
        return math.exp(self.log_n0 + self.a * lc), math.exp(self.log_d0 + self.b * lc)

    def intervals(self, level: float = 0.95) -> dict[str, tuple[float, float]]:
        if self.samples is None or not len(self.samples):
            return {}
        return {
            "a": _interval(self.samples[:, 0], level),
            "b": _interval(self.samples[:, 2], level),
        }

    def predict_intervals(
        self, flops: float, level: float = 0.95
    ) -> dict[str, tuple[float, float]]:
        if self.samples is None or not len(self.samples):
            return {}
        lc = math.log(flops)
        s = self.samples
        return {
            "N": _interval(np.exp(s[:, 1] + s[:, 0] * lc), level),
            "D": _interval(np.exp(s[:, 3] + s[:, 2] * lc), level),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "log_n0": self.log_n0,
            "b": self.b,
            "log_d0": self.log_d0,
            "groups": [g.as_dict() for g in self.groups],
            "skipped": [{"flops": c, "why": why} for c, why in self.skipped],
            "samples": None if self.samples is None else self.samples.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IsoFlopFit:
        samples = data.get("samples")
        return cls(
            groups=[],
            a=float(data["a"]),
            log_n0=float(data["log_n0"]),
            b=float(data["b"]),
            log_d0=float(data["log_d0"]),
            skipped=[(float(s["flops"]), str(s["why"])) for s in data.get("skipped", [])],
            samples=None if samples is None else np.asarray(samples, dtype=float).reshape(-1, 4),
        )


def group_by_flops(
    points: Sequence[Point], *, rtol: float = 0.1, groups: Sequence[Hashable] | None = None
) -> list[list[Point]]:
    """The points in IsoFLOP groups, smallest budget first: by ``groups`` (one key per point)
    when given, else by each point's ``budget`` when every point has one, else by C — sorted,
    a group taking each next point whose C is within ``rtol`` of the group's smallest."""
    if groups is not None:
        if len(groups) != len(points):
            raise LlmkitError(f"groups: {len(groups)} keys for {len(points)} points")
        keyed: dict[Hashable, list[Point]] = {}
        for key, p in zip(groups, points, strict=True):
            keyed.setdefault(key, []).append(p)
        out = list(keyed.values())
    elif points and all(p.budget is not None for p in points):
        by_budget: dict[float, list[Point]] = {}
        for p in points:
            by_budget.setdefault(p.budget, []).append(p)  # type: ignore[arg-type]
        out = list(by_budget.values())
    else:
        out = []
        for p in sorted(points, key=lambda q: q.flops):
            if out and p.flops <= out[-1][0].flops * (1 + rtol):
                out[-1].append(p)
            else:
                out.append([p])
    return sorted(out, key=lambda g: _geomean([p.flops for p in g]))


def _geomean(values: Sequence[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


def _group_minimum(points: Sequence[Point], min_sizes: int) -> IsoGroup | str:
    """The parabola's minimum of one group, or why there is none."""
    sizes = {p.N for p in points}
    if len(sizes) < min_sizes:
        return f"{len(sizes)} model sizes (needs {min_sizes})"
    x = np.log([p.N for p in points])
    loss = np.array([p.loss for p in points])
    c2, c1, c0 = np.polyfit(x, loss, 2)
    if not c2 > 0:
        return "loss is not convex in log N (no minimum)"
    x_opt = -c1 / (2 * c2)
    if not x.min() <= x_opt <= x.max():
        return (
            f"the minimum (N ≈ {math.exp(x_opt):.3g}) lies outside the sizes tried "
            f"({min(sizes):.3g}–{max(sizes):.3g})"
        )
    flops = _geomean([p.flops for p in points])
    # D at the minimum from the group's own C/(N·D), interpolated linearly in log N: the
    # model's FLOP accounting (attention, output head) links N and D, not 6ND.
    ks = np.log([p.flops / (p.N * p.D) for p in points])
    if len(set(x)) >= 2 and np.ptp(ks) > 0:
        slope, icpt = np.polyfit(x, ks, 1)
        k = math.exp(icpt + slope * x_opt)
    else:
        k = math.exp(float(ks.mean()))
    n_opt = math.exp(x_opt)
    return IsoGroup(
        flops=flops,
        points=list(points),
        coef=(float(c2), float(c1), float(c0)),
        N=n_opt,
        D=flops / (k * n_opt),
        loss=float(np.polyval([c2, c1, c0], x_opt)),
        k=k,
    )


def _power_laws(groups: Sequence[IsoGroup]) -> tuple[float, float, float, float]:
    lc = np.log([g.flops for g in groups])
    a, log_n0 = np.polyfit(lc, np.log([g.N for g in groups]), 1)
    b, log_d0 = np.polyfit(lc, np.log([g.D for g in groups]), 1)
    return float(a), float(log_n0), float(b), float(log_d0)


def isoflop_minima(
    points: Sequence[Point],
    *,
    rtol: float = 0.1,
    groups: Sequence[Hashable] | None = None,
    min_sizes: int = 3,
    min_groups: int = 2,
    bootstrap: int = 0,
    seed: int = 0,
) -> IsoFlopFit:
    """Hoffmann et al.'s approach 2. Group the points by compute budget
    (:func:`group_by_flops`), fit a parabola of loss against ln N in each group with at least
    ``min_sizes`` sizes, take its minimum N_opt(C) — a group whose minimum lies outside the
    sizes it tried is skipped, a vertex found by extrapolation is not trusted — and fit
    N_opt = n₀·C^a and D_opt = d₀·C^b across the groups.

    D_opt = C / (k·N_opt), with k = C/(N·D) interpolated from the group's own points (the
    model's FLOP accounting; exactly 6 for points without C, where C = 6ND is assumed).
    ``bootstrap`` > 0 resamples the points within each group that many times for intervals
    of a and b."""
    for p in points:
        make_point(p.N, p.D, p.loss, p.C, source=p.source, budget=p.budget)
    found: list[IsoGroup] = []
    skipped: list[tuple[float, str]] = []
    for group in group_by_flops(points, rtol=rtol, groups=groups):
        result = _group_minimum(group, min_sizes)
        if isinstance(result, str):
            skipped.append((_geomean([p.flops for p in group]), result))
        else:
            found.append(result)
    if len(found) < min_groups:
        why = "; ".join(f"C ≈ {c:.3g}: {w}" for c, w in skipped) or "no groups"
        raise LlmkitError(
            f"IsoFLOP minima need at least {min_groups} compute budgets with a minimum inside "
            f"{min_sizes}+ model sizes each; found {len(found)} ({why})"
        )
    fit = IsoFlopFit(found, *_power_laws(found), skipped=skipped)
    if bootstrap > 0:
        rng = np.random.default_rng(seed)
        samples = []
        for _ in range(bootstrap):
            resampled = []
            for g in found:
                idx = rng.integers(0, len(g.points), len(g.points))
                result = _group_minimum([g.points[i] for i in idx], min_sizes)
                if not isinstance(result, str):
                    resampled.append(result)
            if len(resampled) >= 2 and len({g.flops for g in resampled}) >= 2:
                samples.append(_power_laws(resampled))
        fit.samples = np.array(samples) if samples else None
    return fit


# -- saving and loading a fit ---------------------------------------------------------------------


def fit_report(
    fit: LawFit,
    boot: Bootstrap | None = None,
    iso: IsoFlopFit | None = None,
    *,
    level: float = 0.95,
    sources: Sequence[str] = (),
) -> dict[str, Any]:
    """The fit as JSON-ready data: the law, its intervals and bootstrap samples, the IsoFLOP
    result, and the input points."""
    return {
        "law": fit.as_dict(),
        "level": level,
        "intervals": None
        if boot is None
        else {k: list(v) for k, v in boot.intervals(level).items()},
        "bootstrap": None if boot is None else boot.as_dict(),
        "isoflop": None if iso is None else {**iso.as_dict(), "intervals": iso.intervals(level)},
        "sources": list(sources),
        "points": [p.as_dict() for p in fit.points],
    }


def save_fit(path: str | Path, report: dict[str, Any]) -> Path:
    """Write :func:`fit_report`'s data to ``path`` as JSON."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, indent=2, allow_nan=True) + "\n")
    return p


def load_fit(path: str | Path) -> tuple[LawFit, Bootstrap | None, IsoFlopFit | None]:
    """A fit written by :func:`save_fit` (``llmkit scaling fit --out``)."""
    p = Path(path)
    try:
        data = json.loads(_read_text(p))
        points = [
            make_point(q["N"], q["D"], q["loss"], q.get("C"), source=q.get("source", ""))
            for q in data.get("points", [])
        ]
        fit = LawFit.from_dict(data["law"], points)
        boot = Bootstrap.from_dict(data["bootstrap"]) if data.get("bootstrap") else None
        iso = IsoFlopFit.from_dict(data["isoflop"]) if data.get("isoflop") else None
    except LlmkitError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise LlmkitError(f"{p}: not a scaling fit (llmkit scaling fit --out): {exc}") from None
    return fit, boot, iso


# -- the plot -------------------------------------------------------------------------------------


def _representative(values: Sequence[float], most: int = 6) -> list[float]:
    distinct = sorted(set(values))
    if len(distinct) <= most:
        return distinct
    q = np.quantile(np.log(distinct), np.linspace(0, 1, most - 1))
    return sorted({float(np.exp(v)) for v in q})


def plot_fit(
    path: str | Path,
    fit: LawFit,
    iso: IsoFlopFit | None = None,
    *,
    title: str = "",
) -> Path:
    """A PNG: loss against N with L(N, D) at representative D; loss against C with the
    compute-optimal frontier (and the IsoFLOP minima); the IsoFLOP parabolas when given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    pts = fit.points
    n = np.array([p.N for p in pts])
    d = np.array([p.D for p in pts])
    c = np.array([p.flops for p in pts])
    loss = np.array([p.loss for p in pts])
    panels = 3 if iso is not None and iso.groups else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), dpi=100)
    cmap = plt.get_cmap("viridis")

    ax = axes[0]
    d_norm = LogNorm(d.min(), max(d.max(), d.min() * 1.0001))
    ax.scatter(n, loss, c=d, cmap=cmap, norm=d_norm, s=18, zorder=3)
    grid_n = np.geomspace(n.min() / 1.5, n.max() * 1.5, 200)
    for dv in _representative(d.tolist()):
        ax.plot(grid_n, fit.predict(grid_n, dv), color=cmap(d_norm(dv)), lw=1)
    ax.set(xscale="log", xlabel="N (non-embedding parameters)", ylabel="loss")
    ax.set_title(
        f"L = {fit.E:.3g} + {fit.A:.3g}/N^{fit.alpha:.3g} + {fit.B:.3g}/D^{fit.beta:.3g}",
        fontsize=9,
    )
    fig.colorbar(plt.cm.ScalarMappable(norm=d_norm, cmap=cmap), ax=ax, label="D (tokens)")

    ax = axes[1]
    n_norm = LogNorm(n.min(), max(n.max(), n.min() * 1.0001))
    ax.scatter(c, loss, c=n, cmap="plasma", norm=n_norm, s=18, zorder=3)
    if fit.alpha > 0 and fit.beta > 0:
        grid_c = np.geomspace(c.min() / 2, c.max() * 10, 200)
        k = fit.flops_per_param_token
        frontier = [
            _frontier(np.array([list(fit.params().values())]), cv, k)[2][0] for cv in grid_c
        ]
        ax.plot(grid_c, frontier, "k-", lw=1, label=f"compute-optimal (C = {k:.3g}·N·D)")
    if iso is not None and iso.groups:
        ax.scatter(
            [g.flops for g in iso.groups],
            [g.loss for g in iso.groups],
            marker="*",
            s=90,
            color="red",
            zorder=4,
            label="IsoFLOP minima",
        )
    ax.set(xscale="log", xlabel="C (training FLOPs)", ylabel="loss")
    ax.legend(fontsize=8)
    fig.colorbar(plt.cm.ScalarMappable(norm=n_norm, cmap="plasma"), ax=ax, label="N")

    if panels == 3 and iso is not None:
        ax = axes[2]
        c_norm = LogNorm(iso.groups[0].flops, max(iso.groups[-1].flops, iso.groups[0].flops * 1.01))
        for g in iso.groups:
            color = plt.get_cmap("cividis")(c_norm(g.flops))
            gn = np.array([p.N for p in g.points])
            ax.scatter(gn, [p.loss for p in g.points], color=color, s=18, zorder=3)
            xs = np.linspace(np.log(gn.min()), np.log(gn.max()), 100)
            ax.plot(
                np.exp(xs), np.polyval(g.coef, xs), color=color, lw=1, label=f"C = {g.flops:.2g}"
            )
            ax.plot(g.N, g.loss, "r*", ms=9, zorder=4)
        ax.set(xscale="log", xlabel="N", ylabel="loss")
        ax.set_title(f"IsoFLOP: N_opt ∝ C^{iso.a:.3g}, D_opt ∝ C^{iso.b:.3g}", fontsize=9)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p)
    plt.close(fig)
    return p
