"""Training: from a resolved spec to a run directory.

Modules, each one thing:

- :mod:`~llmkit.training.entry`: :func:`train`, what ``llmkit train`` calls (new or resumed);
- :mod:`~llmkit.training.trainer`: :class:`Trainer` (set-up, the loop, evaluation, saving);
- :mod:`~llmkit.training.result`: :class:`TrainResult` (how a run ended), the objective's
  name and the validation line;
- :mod:`~llmkit.training.step`: :class:`TrainStep`, one optimizer step — the function the
  training benchmarks time;
- :mod:`~llmkit.training.strategy`: :class:`ParallelStrategy`, single process, DDP, FSDP or
  a device mesh; :mod:`~llmkit.training.pipelined`: a pipeline rank's stages in training;
- :mod:`~llmkit.training.plan`: :class:`RunPlan`, a run settled before it reads data (the
  spec read and resolved once; init weights, teacher, tokenizer, vocabulary, objective);
- :mod:`~llmkit.training.progress`: the progress bar and stop signals;
- :mod:`~llmkit.training.sample`: the end-of-training sample from the in-memory model;
- :mod:`~llmkit.training.distributed`: process-group plumbing under torchrun.

What the trainer uses from below: the objective (:mod:`llmkit.model.objective`), the run's
metrics log (:mod:`llmkit.runs.metrics`) and the validation loss
(:mod:`llmkit.evaluation.perplexity`).

The trainer knows no concrete component: every part comes from the resolved spec, and every
auxiliary loss or metric a component reports arrives through the model output's side channel.
"""

from llmkit.training import distributed
from llmkit.training.entry import train
from llmkit.training.plan import RunPlan, plan_run
from llmkit.training.result import NonFiniteLoss, TrainResult
from llmkit.training.sample import sample_text
from llmkit.training.step import StepResult, TrainStep
from llmkit.training.strategy import ParallelStrategy
from llmkit.training.trainer import Trainer

__all__ = [
    "NonFiniteLoss",
    "ParallelStrategy",
    "RunPlan",
    "StepResult",
    "TrainResult",
    "TrainStep",
    "Trainer",
    "distributed",
    "plan_run",
    "sample_text",
    "train",
]
