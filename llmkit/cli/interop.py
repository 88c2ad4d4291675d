"""``llmkit import-hf`` and ``llmkit export-hf``: Hugging Face checkpoints in and out."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from llmkit.cli.common import WEIGHTS, console


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "import-hf",
        run_import,
        help="a local Hugging Face checkpoint directory as an llmkit run",
        configure=configure_import,
    )
    register(
        "export-hf",
        run_export,
        help="a run as a Hugging Face checkpoint directory (a native family, else remote code)",
        configure=configure_export,
    )


def configure_import(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", help="local checkpoint: config.json, weights, tokenizer files")
    p.add_argument("out", help="new run directory (absent or empty)")
    p.add_argument(
        "--attention",
        default="sdpa",
        help="attention kernel of full-attention layers (sdpa, flash, dense, ...)",
    )


def configure_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run (or checkpoint) directory")
    p.add_argument("out", help="output directory (absent or empty)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights' dtype; auto: the imported checkpoint's, else float32",
    )
    p.add_argument("--weights", choices=WEIGHTS, default="final")
    p.add_argument(
        "--native-only",
        action="store_true",
        help="refuse a model no native transformers family holds (each family's reason) "
        "instead of exporting it as llmkit remote code",
    )


def run_import(args: argparse.Namespace) -> int:
    from llmkit.interop.runs import import_hf

    imported = import_hf(args.hf_dir, args.out, attention=args.attention)
    m, cfg = imported.model, imported.config
    n = sum(p.numel() for p in m.parameters())
    con = console()
    con.print(f"imported {cfg.get('model_type')} ({n:,} parameters) -> {args.out}", markup=False)
    for note in imported.notes:
        con.print(f"note: {note}", markup=False)
    return 0


def run_export(args: argparse.Namespace) -> int:
    from llmkit.interop.runs import export_hf

    done = export_hf(
        args.run, args.out, dtype=args.dtype, which=args.weights, native_only=args.native_only
    )
    line = f"exported {args.run} -> {args.out} as {done.how()}: {', '.join(done.files)}"
    console().print(line, markup=False)
    return 0
