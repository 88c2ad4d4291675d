"""Evaluation beyond perplexity: downstream tasks scored by log-likelihood, and the
lm-eval-harness adapter.

Modules: :mod:`~llmkit.evaluation.loglik` (scoring (context, continuation) pairs, batched,
through the KV cache where contexts are shared), :mod:`~llmkit.evaluation.tasks` (task specs,
the built-in formats, few-shot prompts), :mod:`~llmkit.evaluation.runner` (metrics, standard
errors, results in the run directory) and :mod:`~llmkit.evaluation.harness` (lm-eval-harness's
``LM`` over an llmkit run; needs the ``lm-eval`` extra). Perplexity itself (per token, per
byte, sliding windows) is :mod:`llmkit.training.evaluate`'s.

The Python API::

    from llmkit.evaluation import LoglikScorer, evaluate_task, load_task
    from llmkit.runs import load_run

    run = load_run("runs/tiny-...")
    scorer = LoglikScorer(run.model, run.tokenizer)
    result = evaluate_task(scorer, load_task("hellaswag=hellaswag_val.jsonl"), num_fewshot=0)
    result.metrics  # {"acc": ..., "acc_stderr": ..., "acc_norm": ..., ...}
"""

from llmkit.evaluation.loglik import Loglik, LoglikScorer, TokenRequest
from llmkit.evaluation.runner import (
    EVAL_DIR,
    ItemScore,
    TaskResult,
    evaluate_task,
    save_result,
    score_items,
    task_metrics,
)
from llmkit.evaluation.tasks import BUILTIN, Item, Task, TaskSpec, load_task, read_jsonl

__all__ = [
    "BUILTIN",
    "EVAL_DIR",
    "Item",
    "ItemScore",
    "Loglik",
    "LoglikScorer",
    "Task",
    "TaskResult",
    "TaskSpec",
    "TokenRequest",
    "evaluate_task",
    "load_task",
    "read_jsonl",
    "save_result",
    "score_items",
    "task_metrics",
]
