"""Training: from a resolved spec to a run directory.

Modules, each one thing:

- :mod:`~llmkit.training.entry`: :func:`train`, what ``llmkit train`` calls (new or resumed);
- :mod:`~llmkit.training.trainer`: :class:`Trainer` (set-up, the loop, evaluation, saving)
  and :class:`TrainResult`;
- :mod:`~llmkit.training.step`: :class:`TrainStep`, one optimizer step — the function the
  training benchmarks time;
- :mod:`~llmkit.training.objective`: :class:`Objective`, the model's cross-entropy or the
  spec's ``loss`` component, for training and evaluation alike;
- :mod:`~llmkit.training.strategy`: :class:`ParallelStrategy`, single process, DDP or FSDP;
- :mod:`~llmkit.training.resume`: what a new or resumed run may start from;
- :mod:`~llmkit.training.metrics`: ``metrics.jsonl`` and the loss curve;
- :mod:`~llmkit.training.progress`: the progress bar and stop signals;
- :mod:`~llmkit.training.evaluate`: loss, perplexity and bits per byte;
- :mod:`~llmkit.training.sample`: the end-of-training sample from the in-memory model;
- :mod:`~llmkit.training.distributed`: process-group plumbing under torchrun.

The trainer knows no concrete component: every part comes from the resolved spec, and every
auxiliary loss or metric a component reports arrives through the model output's side channel.
"""

from llmkit.training import distributed
from llmkit.training.entry import train
from llmkit.training.evaluate import (
    EvalResult,
    evaluate_batches,
    full_text_batches,
    sliding_batches,
    sliding_windows,
)
from llmkit.training.metrics import MetricsLog, plot_losses
from llmkit.training.objective import Objective, ObjectiveOutput
from llmkit.training.sample import sample_text
from llmkit.training.step import StepResult, TrainStep
from llmkit.training.strategy import ParallelStrategy
from llmkit.training.trainer import NonFiniteLoss, Trainer, TrainResult

__all__ = [
    "EvalResult",
    "MetricsLog",
    "NonFiniteLoss",
    "Objective",
    "ObjectiveOutput",
    "ParallelStrategy",
    "StepResult",
    "TrainResult",
    "TrainStep",
    "Trainer",
    "distributed",
    "evaluate_batches",
    "full_text_batches",
    "plot_losses",
    "sample_text",
    "sliding_batches",
    "sliding_windows",
    "train",
]
