"""Scaling laws: fit L(N, D) = E + A/N^α + B/D^β to runs, find IsoFLOP minima, and plan
the compute-optimal model size and token count for a FLOP budget.

Two of the three methods of Hoffmann et al. 2022, "Training Compute-Optimal Large Language
Models" (Chinchilla), arXiv:2203.15556:

* approach 3 (:func:`fit_loss_law`, :mod:`.law`): fit the five parameters of L(N, D) to every
  (N, D, loss) point by minimising a Huber loss (δ = 10⁻³) on log-loss with L-BFGS from a
  grid of initialisations; the compute-optimal frontier is then closed form (their eq. 4,
  :func:`compute_optimal`);
* approach 2 (:func:`isoflop_minima`, :mod:`.isoflop`): group runs of equal compute, fit a
  parabola of loss against log N in each group, and fit power laws N_opt ∝ C^a,
  D_opt ∝ C^b to the minima.

Uncertainty comes from refitting on bootstrap resamples of the points (:func:`bootstrap`), as
Besiroglu et al. 2024, "Chinchilla Scaling: A replication attempt" (arXiv:2404.10102), did
when they refitted approach 3 and found the original intervals implausibly narrow.

Here N counts non-embedding parameters (Kaplan et al. 2020, arXiv:2001.08361; what
``llmkit info`` reports as non-embedding), D the training tokens, and C the training FLOPs by
the model's own accounting (``Transformer.flops_per_token()["train"]`` × D), not 6ND. The
points come from :mod:`.points`; :mod:`.report` saves, loads and plots a fit.
"""

from llmkit.experiments.scaling.isoflop import IsoFlopFit, IsoGroup, group_by_flops, isoflop_minima
from llmkit.experiments.scaling.law import (
    Bootstrap,
    LawFit,
    Plan,
    bootstrap,
    compute_optimal,
    fit_loss_law,
)
from llmkit.experiments.scaling.points import (
    RESULTS_FILES,
    Point,
    check_points,
    make_point,
    points_from_csv,
    points_from_runs,
    points_from_sources,
    points_from_sweep,
)
from llmkit.experiments.scaling.report import fit_report, load_fit, plot_fit, save_fit

__all__ = [
    "RESULTS_FILES",
    "Bootstrap",
    "IsoFlopFit",
    "IsoGroup",
    "LawFit",
    "Plan",
    "Point",
    "bootstrap",
    "check_points",
    "compute_optimal",
    "fit_loss_law",
    "fit_report",
    "group_by_flops",
    "isoflop_minima",
    "load_fit",
    "make_point",
    "plot_fit",
    "points_from_csv",
    "points_from_runs",
    "points_from_sources",
    "points_from_sweep",
    "save_fit",
]
