"""A fit as JSON (save, load) and as a plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.errors import LlmkitError
from llmkit.experiments.scaling.isoflop import IsoFlopFit
from llmkit.experiments.scaling.law import Bootstrap, LawFit, optimal_frontier
from llmkit.experiments.scaling.points import make_point, read_text

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
        data = json.loads(read_text(p))
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
            optimal_frontier(np.array([list(fit.params().values())]), cv, k)[2][0] for cv in grid_c
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
