"""What the command modules share: console output, the registry, spec loading, number
formats and argparse value types. Nothing here imports torch at module level."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

EXIT_USER_ERROR = 2


def console(stderr: bool = False) -> Any:
    """A rich console (imported on use)."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def table(*columns: str, title: str | None = None) -> Any:
    """A borderless rich table with folding columns."""
    from rich.table import Table

    out = Table(title=title, title_justify="left", box=None, pad_edge=False)
    for col in columns:
        out.add_column(col, overflow="fold")
    return out


def registry() -> Any:
    """The process-wide registry."""
    from llmkit.registry import get_registry

    return get_registry()


def warn_failures(reg: Any) -> None:
    """One warning line on stderr per plugin that failed."""
    from rich.markup import escape

    for info in reg.failures():
        console(stderr=True).print(
            f"[yellow]warning:[/] plugin {info.name!r} ({info.distribution}) failed: "
            f"{escape(info.error)}",
            markup=True,
        )


def write(text: str) -> None:
    """Write to stdout at once (streamed output, pipes)."""
    sys.stdout.write(text)
    sys.stdout.flush()


# -- specs and models ---------------------------------------------------------------------------


def load(path: str, sets: list[str] | None) -> Any:
    """The resolved spec of ``path`` with ``--set`` overrides."""
    from llmkit.spec import load_spec

    return load_spec(path, sets or [])


def ref(res: Any) -> str:
    """A resolved component as ``name(option=value, ...)``, non-default options only."""
    opts = res.options.model_dump(exclude_defaults=True)
    inner = ", ".join(f"{k}={v}" for k, v in opts.items())
    return f"{res.name}({inner})" if inner else res.name


# -- number formats -----------------------------------------------------------------------------


def human(n: float, unit: str = "") -> str:
    """``124M``, ``1.5G``: three significant digits, decimal prefixes."""
    for suffix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{suffix}{unit}"
        n /= 1000
    return f"{n:.3g}E{unit}"


def human_bytes(n: float) -> str:
    """``1.5 GiB``: binary prefixes."""
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {suffix}"
        n /= 1024
    return f"{n:.1f} PiB"


# -- argparse value types -----------------------------------------------------------------------


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer ≥ ``minimum``."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be ≥ {minimum}, got {value}")
        return value

    return integer


def positive_float(what: str = "a number") -> Callable[[str], float]:
    """An argparse type: a finite number > 0 (``1e21`` works), ``what`` naming it in the
    error."""

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        return value

    return number


#: An argparse type: a finite number of seconds > 0.
seconds = positive_float("seconds")


def seed(text: str) -> int:
    """An argparse type: a seed in [0, 2⁶³)."""
    value = at_least(0)(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be < 2**63, got {value}")
    return value


def add_set(parser: argparse.ArgumentParser, help: str = "dotted override") -> None:
    """The repeatable ``--set KEY=VALUE`` spec override."""
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help=help)


WEIGHTS = ["final", "best", "latest"]


#: ``--quantize`` choices (``llmkit.inference.quantize.METHODS``, kept here so that the CLI
#: imports no torch to parse its arguments) and what they mean.
QUANTIZE = ("int8", "int8-weight-only", "bf16", "auto")
QUANTIZE_HELP = (
    "int8 (CPU: fbgemm w8a8-dynamic, the fastest decode), int8-weight-only (int8 weights, "
    "activations kept at about 14 bits: on x86 each row as two 7-bit digits through fbgemm), "
    "bf16 weights, or auto "
    "(int8 on a CPU with fbgemm, bf16 on a GPU that has it)"
)
