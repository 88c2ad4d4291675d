"""``llmkit eval``: loss and perplexity of a run or checkpoint (whole text or sliding windows,
optionally against its int8 quantization), and downstream tasks scored by log-likelihood."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from llmkit.cli.common import (
    QUANTIZE,
    QUANTIZE_HELP,
    WEIGHTS,
    at_least,
    console,
    human_bytes,
    table,
)
from llmkit.errors import LlmkitError


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "eval",
        run_eval,
        help="perplexity and downstream-task accuracy of a run or checkpoint",
        configure=configure_eval,
    )


def configure_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory or checkpoint directory")
    p.add_argument(
        "--data",
        help="a text file (default: the run's validation split; a run without data of its "
        "own, such as an imported checkpoint, needs --data or --task)",
    )
    p.add_argument("--weights", choices=WEIGHTS, default="final")
    p.add_argument("--batch-size", type=at_least(1), default=8)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--quantize",
        choices=QUANTIZE,
        help="also evaluate the model with converted weights, printing both sizes, losses "
        f"and perplexities: {QUANTIZE_HELP}",
    )
    p.add_argument("--json", action="store_true")
    ppl = p.add_argument_group("perplexity (--data or the validation split)")
    ppl.add_argument(
        "--context",
        type=at_least(1),
        help="tokens the model sees per window (default: the run's block size)",
    )
    ppl.add_argument(
        "--stride",
        type=at_least(1),
        help="sliding windows: each window scores this many new tokens after "
        "context − stride tokens of context (default: the context, disjoint windows)",
    )
    tasks = p.add_argument_group("downstream tasks")
    tasks.add_argument(
        "--task",
        action="append",
        default=[],
        metavar="FILE_OR_NAME",
        help="a task spec (.toml) or a built-in format with its data, NAME=FILE.jsonl "
        "(hellaswag, arc_easy, arc_challenge, piqa, openbookqa, winogrande, lambada); "
        "repeat for several. Without --data, only the tasks are evaluated",
    )
    tasks.add_argument(
        "--num-fewshot",
        type=at_least(0),
        help="few-shot examples per prompt (default: the task spec's)",
    )
    tasks.add_argument(
        "--seed", type=int, default=1234, help="picks the few-shot examples (default 1234)"
    )
    tasks.add_argument("--limit", type=at_least(1), help="score only the first N items")
    tasks.add_argument(
        "--log-samples",
        action="store_true",
        help="also write every item's scores to eval/<task>.json",
    )
    tasks.add_argument(
        "--no-save", action="store_true", help="do not write results to the run's eval/"
    )


def run_eval(args: argparse.Namespace) -> int:
    from llmkit import hardware
    from llmkit.runs import load_run

    tasks = _load_tasks(args.task)  # a bad task fails before the model loads
    validation = args.data is None and (not tasks or args.quantize)
    if validation:  # a run without data of its own fails before the model loads, too
        from llmkit.evaluation.perplexity import no_data_message, no_data_of_its_own
        from llmkit.runs import open_run

        found = open_run(args.run)
        reason = no_data_of_its_own(found.dir, found.resolve())
        if reason is not None:
            raise LlmkitError(no_data_message(found.dir, reason))
    run = load_run(args.run, which=args.weights)
    device = hardware.choose_device(args.device)
    run.model.to(device)
    con = console(stderr=args.json)  # with --json, stdout carries the JSON alone
    report: dict[str, Any] = {}
    if args.data is not None or not tasks or args.quantize:  # --quantize compares perplexities
        report.update(_perplexity(con, run, args, device))
    if tasks:
        report["tasks"] = _run_tasks(con, run, tasks, args)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _perplexity(con: Any, run: Any, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    from pathlib import Path

    from llmkit.evaluation.perplexity import file_text, run_perplexity, validation_text

    block = run.spec.spec.data.block_size or run.spec.model.max_seq_len
    context = args.context or block
    if context > run.spec.model.max_seq_len:
        raise LlmkitError(
            f"--context {context} is longer than the model's max_seq_len "
            f"({run.spec.model.max_seq_len})"
        )
    stride = args.stride or context
    if stride > context:
        raise LlmkitError(f"--stride {stride} is longer than the context ({context})")
    text = validation_text(run) if args.data is None else file_text(run, Path(args.data))
    if not text.is_text and (args.context or args.stride):
        raise LlmkitError(
            "--context and --stride apply to text (--data, or a packed validation split)"
        )

    def evaluate(model: Any) -> Any:
        return run_perplexity(
            run,
            text,
            model,
            context=context,
            stride=stride,
            batch_size=args.batch_size,
            device=device,
        )

    try:
        return _report(con, run, text, evaluate, args, context, stride)
    finally:
        text.close()  # the scratch directory a validation split was prepared in


def _report(
    con: Any,
    run: Any,
    text: Any,
    evaluate: Callable[[Any], Any],
    args: argparse.Namespace,
    context: int,
    stride: int,
) -> dict[str, Any]:
    res = evaluate(run.model)
    windows = f", windows of {context} moving by {stride}" if stride != context else ""
    con.print(f"{run.weights} on {text.source}: {res.tokens:,} tokens{windows}", markup=False)
    if res.cross_entropy is not None:
        name = run.spec.components["train.loss"].name
        con.print(f"objective ({name}) {res.loss:.4f} per token", markup=False)
        con.print(f"cross-entropy {res.ce:.4f} nats/token, perplexity {res.ppl:.3f}")
    else:
        con.print(f"loss {res.loss:.4f} nats/token, perplexity {res.ppl:.3f}")
    if res.bits_per_byte is not None:
        con.print(f"{res.nats_per_byte:.4f} nats/byte, {res.bits_per_byte:.4f} bits/byte")
    if res.word_perplexity is not None:
        con.print(f"word perplexity {res.word_perplexity:.3f} ({res.words:,} words)")
    report: dict[str, Any] = {**res.as_dict(), "context": context, "stride": stride}
    if args.quantize:
        report.update(_compare_quantized(con, run, res, evaluate, args.quantize))
    return report


def _load_tasks(refs: list[str]) -> list[Any]:
    if not refs:
        return []
    from llmkit.evaluation import load_task

    tasks = [load_task(ref) for ref in refs]
    names = [t.name for t in tasks]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise LlmkitError(f"--task: {dup} is given twice")
    return tasks


def _run_tasks(
    con: Any, run: Any, tasks: list[Any], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    from llmkit.evaluation import LoglikScorer, evaluate_task, save_result
    from llmkit.evaluation.runner import log_results, weights_step

    scorer = LoglikScorer(run.model, run.tokenizer, batch_size=args.batch_size)
    out = table("task", "items", "shots", "metric", "value", "± stderr")
    results: dict[str, dict[str, Any]] = {}
    done = []
    for task in tasks:
        res = evaluate_task(
            scorer, task, num_fewshot=args.num_fewshot, seed=args.seed, limit=args.limit
        )
        done.append(res)
        results[task.name] = res.as_dict()
        if not args.no_save:
            path = save_result(
                run.run_dir, res, task, weights=run.weights, samples=args.log_samples
            )
            results[task.name]["path"] = str(path)
        first = True
        for name, value in res.metrics.items():
            if name.endswith("_stderr"):
                continue
            err = res.metrics.get(f"{name}_stderr")
            shown = f"{value:.4f}" if name != "ppl" else f"{value:.3f}"
            stderr = f"{err:.4f}" if err is not None and err == err else ""
            cells = (task.name, str(res.n), str(res.num_fewshot)) if first else ("", "", "")
            out.add_row(*cells, name, shown, stderr)
            first = False
    con.print(out)
    if not args.no_save:
        log_results(run.spec, run.run_dir, done, weights_step(run.weights, run.run_dir))
        con.print(f"results in {run.run_dir / 'eval'} and the run's metrics", markup=False)
    return results


def _compare_quantized(
    con: Any, run: Any, res: Any, evaluate: Callable[[Any], Any], method: str
) -> dict[str, Any]:
    """Print the run's and its ``method``-quantized copy's figures side by side; the report's
    additions."""
    from llmkit.evaluation.quantized import compare_quantized

    cmp = compare_quantized(run.model, res, evaluate, method)
    out = table("weights", "bytes", "loss", "perplexity", "bits/byte")
    rows = ((cmp.dtype, cmp.base_bytes, cmp.base), (method, cmp.quantized_bytes, cmp.quantized))
    for name, nbytes, r in rows:
        bpb = f"{r.bits_per_byte:.4f}" if r.bits_per_byte is not None else "-"
        out.add_row(name, human_bytes(nbytes), f"{r.loss:.4f}", f"{r.ppl:.3f}", bpb)
    con.print(out)
    note = "; the bf16 layers hold their weights twice, plain and packed for oneDNN"
    con.print(
        f"{method} ({cmp.backend}, {cmp.linear_layers} linear layers): weights "
        f"{cmp.shrink:.2f}× smaller, loss {cmp.loss_change:+.5f} nats/token, perplexity "
        f"{cmp.perplexity_change:+.2f}%" + (note if cmp.packed_twice else ""),
        markup=False,
    )
    return cmp.as_dict()
