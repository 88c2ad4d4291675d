"""Approach 3 of Hoffmann et al. 2022: the parametric fit of L(N, D), its bootstrap
intervals and the compute-optimal frontier."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmkit.errors import LlmkitError
from llmkit.experiments.scaling.points import SIX, Point, check_points

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
PARAMS = ("E", "A", "B", "alpha", "beta")

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


def interval(values: np.ndarray, level: float) -> tuple[float, float]:
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
        return {k: interval(v, level) for k, v in _derived(self.samples).items()}

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


def optimal_frontier(
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
    n, d, loss = (
        float(v[0]) for v in optimal_frontier(np.array([list(fit.params().values())]), flops, k)
    )
    intervals = {}
    usable = None if boot is None else boot.samples[(boot.samples[:, 3:] > 0).all(axis=1)]
    if usable is not None and len(usable):  # a refit with α or β ≤ 0 has no optimum
        ns, ds, losses = optimal_frontier(usable, flops, k)
        intervals = {
            "N": interval(ns, level),
            "D": interval(ds, level),
            "loss": interval(losses, level),
            "tokens_per_param": interval(ds / ns, level),
        }
    return Plan(flops, k, n, d, loss, intervals, level)
