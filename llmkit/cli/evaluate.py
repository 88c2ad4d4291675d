"""``llmkit eval``: loss and perplexity of a run or checkpoint, optionally against its int8
quantization."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from llmkit.cli.common import WEIGHTS, at_least, console, human_bytes, table
from llmkit.errors import LlmkitError


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "eval",
        run_eval,
        help="loss and perplexity of a run or checkpoint",
        configure=configure_eval,
    )


def configure_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory or checkpoint directory")
    p.add_argument("--data", help="a text file (default: the run's validation split)")
    p.add_argument("--weights", choices=WEIGHTS, default="final")
    p.add_argument("--batch-size", type=at_least(1), default=8)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--quantize",
        choices=["int8"],
        help="also evaluate int8 weights: prints both sizes, losses and perplexities",
    )
    p.add_argument("--json", action="store_true")


def _tokens(run: Any, data: str | None) -> tuple[Any, int | None, str]:
    """The tokens to evaluate on, their text's size in bytes, and where they came from:
    ``data`` (a text file), or the run's validation split — its token file itself when only
    some tokens are trained (chat data: the assistant's) or rows are padded, whose bytes
    then mean nothing per token (None)."""
    import torch

    if data is None:
        from llmkit.data import prepare_data

        prepared = prepare_data(run.spec, run.run_dir, run.tokenizer, log=lambda _m: None)
        val = prepared.validation
        if val.has_mask or val.layout != "packed":
            return val, None, "validation split (trained tokens)"
        tokens = torch.from_numpy(val.array.astype("int64"))
        return tokens, val.n_bytes_text, "validation split"
    from pathlib import Path

    from llmkit.components.dataset import read_utf8

    path = Path(data)
    if path.is_dir():
        raise LlmkitError(f"--data: {path} is a directory; expected a text file")
    if not path.is_file():
        raise LlmkitError(f"--data: file not found: {path}")
    text = read_utf8(path)
    if not text:
        raise LlmkitError(f"--data: {path} is empty")
    ids = run.tokenizer.encode(text)
    note = run.tokenizer.unknown_note(ids, str(path))
    if note:
        import logging

        logging.getLogger("llmkit").info(f"--data: {note}")
    tokens = torch.tensor(ids, dtype=torch.long)
    if tokens.numel() < 2:
        raise LlmkitError(f"--data: {path} has fewer than 2 tokens")
    return tokens, len(text.encode("utf-8")), str(path)


def run_eval(args: argparse.Namespace) -> int:
    import torch

    from llmkit import hardware
    from llmkit.data import eval_batches, eval_rows
    from llmkit.runs import load_run
    from llmkit.training import Objective
    from llmkit.training.evaluate import evaluate_batches, full_text_batches

    run = load_run(args.run, which=args.weights)
    device = hardware.choose_device(args.device)
    run.model.to(device)
    block = run.spec.spec.data.block_size or run.spec.model.max_seq_len
    tokens, text_bytes, source = _tokens(run, args.data)
    objective = Objective.from_spec(run.spec)  # what the run trained on (val_loss)

    def evaluate(model: Any) -> Any:
        if isinstance(tokens, torch.Tensor):
            batches = full_text_batches(tokens, block, args.batch_size)
        else:  # every row holding a trained token, once
            rows = len(eval_rows(tokens, block))
            batches = eval_batches(tokens, block, args.batch_size, -(-rows // args.batch_size))
        res = evaluate_batches(model, batches, device, objective=objective)
        res.text_bytes = text_bytes
        return res

    res = evaluate(run.model)
    con = console(stderr=args.json)  # with --json, stdout carries the JSON alone
    con.print(f"{run.weights} on {source}: {res.tokens:,} tokens", markup=False)
    if res.cross_entropy is not None:
        name = run.spec.components["train.loss"].name
        con.print(f"objective ({name}) {res.loss:.4f} per token", markup=False)
        con.print(f"cross-entropy {res.ce:.4f} nats/token, perplexity {res.ppl:.3f}")
    else:
        con.print(f"loss {res.loss:.4f} nats/token, perplexity {res.ppl:.3f}")
    if res.bits_per_byte is not None:
        con.print(f"{res.nats_per_byte:.4f} nats/byte, {res.bits_per_byte:.4f} bits/byte")
    report = res.as_dict()
    if args.quantize:
        report.update(_compare_quantized(con, run, res, evaluate, args.quantize))
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _compare_quantized(
    con: Any, run: Any, res: Any, evaluate: Callable[[Any], Any], method: str
) -> dict[str, Any]:
    """Evaluate the ``method``-quantized model, print both side by side; the report's
    additions (``weight_bytes`` and the quantized results under ``method``)."""
    from llmkit.inference.quantize import quantize_model, weight_bytes

    try:
        qmodel = quantize_model(run.model, method)
    except ValueError as exc:
        raise LlmkitError(str(exc)) from exc
    qres = evaluate(qmodel)
    base_bytes, q_bytes = weight_bytes(run.model), weight_bytes(qmodel)
    dtype = str(next(run.model.parameters()).dtype).removeprefix("torch.")
    info = qmodel.quantization
    out = table("weights", "bytes", "loss", "perplexity", "bits/byte")
    for name, nbytes, r in ((dtype, base_bytes, res), (method, q_bytes, qres)):
        bpb = f"{r.bits_per_byte:.4f}" if r.bits_per_byte is not None else "-"
        out.add_row(name, human_bytes(nbytes), f"{r.loss:.4f}", f"{r.ppl:.3f}", bpb)
    con.print(out)
    con.print(
        f"{method} ({info.backend}, {info.linears} linear layers): weights "
        f"{base_bytes / max(q_bytes, 1):.2f}× smaller, loss {qres.loss - res.loss:+.5f} "
        f"nats/token, perplexity {100 * (qres.ppl / res.ppl - 1):+.2f}%",
        markup=False,
    )
    return {
        "weight_bytes": base_bytes,
        method: {
            **qres.as_dict(),
            "weight_bytes": q_bytes,
            "backend": info.backend,
            "linear_layers": info.linears,
        },
    }
