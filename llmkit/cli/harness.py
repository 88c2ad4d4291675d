"""``llmkit lm-eval``: lm-eval-harness's command line with llmkit runs as a model
(``--model llmkit --model_args run=RUN``); needs the ``lm-eval`` extra."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

DESCRIPTION = """\
Runs lm-eval-harness's own command line, every argument passed to it untouched, with llmkit
runs known to it as the model `llmkit`. Model arguments: run (a run or checkpoint
directory), weights (final, best, latest), batch_size, device, max_length, max_gen_toks.
Local task configs come from --include_path DIR. Example:

  llmkit lm-eval --model llmkit --model_args run=runs/tiny --tasks mytask --include_path tasks/

`llmkit lm-eval --help` shows lm-eval's help, `llmkit lm-eval run --help` its options.
Needs: pip install 'llmkit[lm-eval]'."""


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "lm-eval",
        run_lm_eval,
        help="evaluate a run with lm-evaluation-harness (its arguments, --model llmkit)",
        description=DESCRIPTION,
        configure=configure_lm_eval,
    )


def configure_lm_eval(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.usage = "llmkit lm-eval [LM-EVAL ARGUMENTS ...]"
    p.add_argument("args", nargs=argparse.REMAINDER, help="lm-eval's arguments, -h included")
    # Every argument is lm-eval's, options included: with no prefix character this parser
    # reads none of them as its own (argparse.REMAINDER alone leaves a leading option, such
    # as --model, unrecognized), so they all reach lm-eval, -h among them.
    p.prefix_chars = "\0"


def run_lm_eval(args: argparse.Namespace) -> int:
    if not args.args:  # `llmkit lm-eval` alone: how to use it (`--help` is lm-eval's)
        args._parser.print_help()
        return 0
    from llmkit.evaluation.harness import main

    return main(list(args.args))
