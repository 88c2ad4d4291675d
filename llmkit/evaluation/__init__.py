"""Evaluation: loss and perplexity, downstream tasks scored by log-likelihood, and the
lm-eval-harness adapter.

Modules: :mod:`~llmkit.evaluation.perplexity` (the objective, perplexity per token, byte and
word, whole text or sliding windows; the trainer's validation uses it),
:mod:`~llmkit.evaluation.quantized` (a run against its quantized copy),
:mod:`~llmkit.evaluation.loglik` (scoring (context, continuation) pairs, batched, through the
KV cache where contexts are shared), :mod:`~llmkit.evaluation.tasks` (task specs, the
built-in formats, few-shot prompts), :mod:`~llmkit.evaluation.runner` (metrics, standard
errors, results in the run directory) and :mod:`~llmkit.evaluation.harness`
(lm-eval-harness's ``LM`` over an llmkit run; needs the ``lm-eval`` extra).

The Python API::

    from llmkit.evaluation import LoglikScorer, evaluate_task, load_task
    from llmkit.runs import load_run

    run = load_run("runs/tiny-...")
    scorer = LoglikScorer(run.model, run.tokenizer)
    result = evaluate_task(scorer, load_task("hellaswag=hellaswag_val.jsonl"), num_fewshot=0)
    result.metrics  # {"acc": ..., "acc_stderr": ..., "acc_norm": ..., ...}
"""

from llmkit.evaluation.loglik import Loglik, LoglikScorer, TokenRequest
from llmkit.evaluation.perplexity import (
    EvalResult,
    EvalText,
    evaluate_batches,
    file_text,
    full_text_batches,
    run_perplexity,
    sliding_batches,
    sliding_windows,
    validation_text,
)
from llmkit.evaluation.quantized import QuantizedComparison, compare_quantized
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
    "EvalResult",
    "EvalText",
    "Item",
    "ItemScore",
    "Loglik",
    "LoglikScorer",
    "QuantizedComparison",
    "Task",
    "TaskResult",
    "TaskSpec",
    "TokenRequest",
    "compare_quantized",
    "evaluate_batches",
    "evaluate_task",
    "file_text",
    "full_text_batches",
    "load_task",
    "read_jsonl",
    "run_perplexity",
    "save_result",
    "score_items",
    "sliding_batches",
    "sliding_windows",
    "task_metrics",
    "validation_text",
]
