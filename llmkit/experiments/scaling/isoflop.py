"""Approach 2 of Hoffmann et al. 2022: IsoFLOP parabolas and the power laws of their
minima."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmkit.errors import LlmkitError
from llmkit.experiments.scaling.law import interval
from llmkit.experiments.scaling.points import Point, make_point

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
            "a": interval(self.samples[:, 0], level),
            "b": interval(self.samples[:, 2], level),
        }

    def predict_intervals(
        self, flops: float, level: float = 0.95
    ) -> dict[str, tuple[float, float]]:
        if self.samples is None or not len(self.samples):
            return {}
        lc = math.log(flops)
        s = self.samples
        return {
            "N": interval(np.exp(s[:, 1] + s[:, 0] * lc), level),
            "D": interval(np.exp(s[:, 3] + s[:, 2] * lc), level),
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
