"""``llmkit merge-lora``: fold a run's adapters into plain weights, as a new run."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from llmkit.cli.common import WEIGHTS, console


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "merge-lora",
        run_merge,
        help="merge a run's adapters (LoRA, DoRA) into its weights, as a new run",
        configure=configure_merge,
    )


def configure_merge(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run (or checkpoint) directory with model.adapter")
    p.add_argument("out", help="new run directory for the merged model (absent or empty)")
    p.add_argument("--weights", choices=WEIGHTS, default="final")


def run_merge(args: argparse.Namespace) -> int:
    from llmkit.runs.merge import merge_run

    out, layers = merge_run(args.run, args.out, args.weights)
    console().print(f"merged adapters of {layers} layers: {out}", markup=False)
    return 0
