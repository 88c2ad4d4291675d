"""Benchmarks: training steps (:mod:`~llmkit.bench.training`), kernels
(:mod:`~llmkit.bench.kernels`) and generation (:mod:`~llmkit.bench.generation`).

The training-step helpers are re-exported here; the kernel and generation benchmarks are
imported from their modules (they are heavier and have command lines of their own).
"""

from llmkit.bench.training import StepTiming, build_training_step, time_training_step

__all__ = ["StepTiming", "build_training_step", "time_training_step"]
