"""Experiments over many runs: sweeps, scaling-law fits and run comparison.

Modules: :mod:`~llmkit.experiments.sweep` (sweep files, trials, results),
:mod:`~llmkit.experiments.scaling` (L(N, D) fits, IsoFLOP minima, compute-optimal plans) and
:mod:`~llmkit.experiments.compare` (what differs between runs, and their metrics).
"""
