"""Experiments over many runs: sweeps, hyperparameter search, scaling-law fits and run
comparison.

Modules: :mod:`~llmkit.experiments.sweep` (sweep files, trials, results),
:mod:`~llmkit.experiments.search` (Optuna studies), :mod:`~llmkit.experiments.distributions`
(the distributions a random sweep draws and a search samples),
:mod:`~llmkit.experiments.trial` (the one way either trains a trial: an ``llmkit train``
subprocess), :mod:`~llmkit.experiments.scaling` (L(N, D) fits, IsoFLOP minima,
compute-optimal plans) and :mod:`~llmkit.experiments.compare` (what differs between runs,
and their metrics).
"""
