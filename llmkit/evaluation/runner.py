"""Scoring a task with a model, its metrics, and where the results go.

Metrics of a multiple-choice item pick the choice with the highest log-likelihood, summed
(``acc``) or normalised by the choice's length: in characters of the choice's text
(``acc_norm``, lm-eval-harness's definition), in tokens (``acc_norm_token``) and in UTF-8
bytes of the scored continuation (``acc_norm_byte``). A completion item is right when greedy
decoding produces its target (``acc``); ``ppl`` is exp(−mean target log-likelihood), as
LAMBADA reports it. Every accuracy comes with its standard error, sample standard deviation
over √n (lm-eval-harness's ``mean_stderr``).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmkit.errors import LlmkitError
from llmkit.evaluation.loglik import Loglik, LoglikScorer
from llmkit.evaluation.tasks import Item, Task

#: Where a run keeps its task results.
EVAL_DIR = "eval"
HISTORY = "results.jsonl"


@dataclass
class ItemScore:
    """One item's scores: per choice, log-likelihood, tokens, bytes and greedy match."""

    doc_index: int
    gold: int
    logprobs: list[float]
    tokens: list[int]
    bytes: list[int]
    chars: list[int]
    greedy: list[bool]

    def pick(self, by: str = "sum") -> int:
        """The chosen choice: the highest log-likelihood, or per char/token/byte."""
        values = list(self.logprobs)
        if by != "sum":
            norm = {"char": self.chars, "token": self.tokens, "byte": self.bytes}[by]
            values = [lp / max(n, 1) for lp, n in zip(values, norm)]
        return max(range(len(values)), key=values.__getitem__)


@dataclass
class TaskResult:
    """A task's metrics over its items, and the items' scores."""

    task: str
    format: str
    num_fewshot: int
    seed: int
    items: list[ItemScore]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.items)

    def as_dict(self, *, samples: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "task": self.task,
            "format": self.format,
            "items": self.n,
            "num_fewshot": self.num_fewshot,
            "seed": self.seed,
            "metrics": self.metrics,
        }
        if samples:
            out["samples"] = [asdict(s) for s in self.items]
        return out


def _mean_stderr(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def task_metrics(fmt: str, scores: Sequence[ItemScore]) -> dict[str, float]:
    """The metrics of a task's scored items (see the module docstring)."""
    if not scores:
        raise LlmkitError("no items to score")
    out: dict[str, float] = {}

    def add(name: str, values: Sequence[float]) -> None:
        mean, err = _mean_stderr(values)
        out[name], out[f"{name}_stderr"] = mean, err

    if fmt == "completion":
        add("acc", [float(s.greedy[0]) for s in scores])
        out["ppl"] = math.exp(min(-sum(s.logprobs[0] for s in scores) / len(scores), 80.0))
        return out
    add("acc", [float(s.pick() == s.gold) for s in scores])
    if fmt == "multiple_choice":
        add("acc_norm", [float(s.pick("char") == s.gold) for s in scores])
        add("acc_norm_token", [float(s.pick("token") == s.gold) for s in scores])
        add("acc_norm_byte", [float(s.pick("byte") == s.gold) for s in scores])
    out["chance"] = sum(1 / len(s.logprobs) for s in scores) / len(scores)
    return out


def score_items(
    scorer: LoglikScorer, items: Sequence[Item], task: Task | None = None
) -> list[ItemScore]:
    """Every pair of every item scored in one batched call; a pair that cannot be scored
    (a continuation that encodes to no tokens) is an error naming the item, and with
    ``task`` the task and the item's line in its file."""
    requests = []
    for item in items:
        for i, (context, continuation) in enumerate(item.pairs):
            try:
                requests.append(scorer.encode_pair(context, continuation))
            except ValueError as exc:
                where = (
                    task.where(item.doc_index)
                    if task is not None
                    else f"document {item.doc_index + 1}"
                )
                choice = f", choice {i + 1}" if len(item.pairs) > 1 else ""
                raise LlmkitError(f"{where}{choice}: {exc}") from exc
    try:
        scores: list[Loglik] = scorer.score(requests)
    except ValueError as exc:
        raise LlmkitError(str(exc)) from exc
    out, k = [], 0
    for item in items:
        mine = scores[k : k + len(item.pairs)]
        k += len(item.pairs)
        out.append(
            ItemScore(
                doc_index=item.doc_index,
                gold=item.gold,
                logprobs=[s.logprob for s in mine],
                tokens=[s.tokens for s in mine],
                bytes=[len(cont.encode("utf-8")) for _, cont in item.pairs],
                chars=[len(text) for text in item.choice_texts],
                greedy=[s.greedy for s in mine],
            )
        )
    return out


def evaluate_task(
    scorer: LoglikScorer,
    task: Task,
    *,
    num_fewshot: int | None = None,
    seed: int = 1234,
    limit: int | None = None,
) -> TaskResult:
    """Score ``task``'s items (the first ``limit``) with ``num_fewshot`` examples (default:
    the task spec's), drawn with ``seed``."""
    items = task.items(num_fewshot=num_fewshot, seed=seed, limit=limit)
    scores = score_items(scorer, items, task)
    k = task.spec.num_fewshot if num_fewshot is None else num_fewshot
    return TaskResult(
        task.name, task.spec.format, k, seed, scores, task_metrics(task.spec.format, scores)
    )


def _sha256(path: Path | None) -> str | None:
    if path is None or not path.is_file():
        return None
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_result(
    run_dir: Path, result: TaskResult, task: Task, *, weights: Path, samples: bool = False
) -> Path:
    """Write ``eval/<task>[-<k>shot].json`` in the run directory (atomically) and append
    the same record to ``eval/results.jsonl``, the run's history of evaluations."""
    from llmkit.files import write_text_atomic, writing

    directory = run_dir / EVAL_DIR
    stem = result.task + (f"-{result.num_fewshot}shot" if result.num_fewshot else "")
    path = directory / f"{stem}.json"
    record = {
        **result.as_dict(),
        "weights": str(weights),
        "data": str(task.source) if task.source else None,
        "data_sha256": _sha256(task.source),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    full = {**record, **({"samples": result.as_dict(samples=True)["samples"]} if samples else {})}
    directory.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(_finite(full), indent=2) + "\n")
    with writing(path), (directory / HISTORY).open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(_finite(record)) + "\n")
    return path


def weights_step(weights: Path, run_dir: Path) -> int:
    """The training step of a run's weights: a checkpoint's (its ``meta.json``), else the
    last step the run's ``metrics.jsonl`` records (0 when it records none)."""
    meta = weights.parent / "meta.json"
    if weights.parent.name.startswith("step-") and meta.is_file():
        try:
            return int(json.loads(meta.read_text(encoding="utf-8"))["step"])
        except (ValueError, KeyError, TypeError, RecursionError):
            pass
    from llmkit.runs import METRICS_FILE
    from llmkit.runs.metrics import MetricsLog

    steps = [r["step"] for r in MetricsLog(run_dir / METRICS_FILE).read() if "step" in r]
    return max((int(s) for s in steps if isinstance(s, int | float)), default=0)


def log_results(rs: Any, run_dir: Path, results: Sequence[TaskResult], step: int) -> None:
    """One record per task, at the weights' ``step``, through the run's log: its
    ``metrics.jsonl`` and the loggers its spec names (``train.loggers``). A record holds
    ``eval`` (the task's name), ``<task>/<metric>`` values, items and shots."""
    from llmkit.runs.metrics import RunLog

    log = RunLog.for_run(rs, run_dir)
    try:
        for res in results:
            record: dict[str, Any] = {"step": step, "eval": res.task}
            record.update({f"{res.task}/{k}": v for k, v in res.metrics.items()})
            record[f"{res.task}/items"] = res.n
            record[f"{res.task}/num_fewshot"] = res.num_fewshot
            log.write(record)
    finally:
        log.close()


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as null (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
