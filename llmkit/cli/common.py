"""What the command modules share: console output, the registry, spec loading, number
formats and argparse value types. Nothing here imports torch at module level."""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable
from typing import Any

EXIT_USER_ERROR = 2


#: Off a terminal (a pipe, a file) a table is laid out this wide rather than rich's 80
#: columns, so that each row stays one line and no key or path is split.
PIPE_WIDTH = 100_000


def console(stderr: bool = False) -> Any:
    """A rich console (imported on use). Text is never wrapped (``soft_wrap``); a table
    from :func:`table` folds its cells to a terminal's width, and off a terminal keeps
    each row on one line."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def table(*columns: str, title: str | None = None) -> Any:
    """A borderless rich table: on a terminal its columns fold to the terminal's width;
    printed to a pipe or a file, each row is one line however long (no fold, no crop)."""
    out = _table_class()(title=title, title_justify="left", box=None, pad_edge=False)
    for col in columns:
        out.add_column(col, overflow="fold")
    return out


@functools.cache
def _table_class() -> type:
    """``rich.table.Table`` that, off a terminal, is laid out :data:`PIPE_WIDTH` wide
    (rich's own width there is 80 columns, or ``$COLUMNS``) and ends its lines without the
    cells' padding. Its lines are not cropped because :func:`console` prints with
    ``soft_wrap``."""
    from rich.segment import Segment
    from rich.table import Table

    def piped(console: Any) -> bool:
        return not console.is_terminal and not console.is_jupyter

    class PipeTable(Table):
        def __rich_console__(self, console: Any, options: Any) -> Any:
            if not piped(console):
                yield from super().__rich_console__(console, options)
                return
            wide = options.update_width(max(options.max_width, PIPE_WIDTH))
            for line in Segment.split_lines(super().__rich_console__(console, wide)):
                while line and not line[-1].control and not line[-1].text.rstrip():
                    line.pop()
                if line and not line[-1].control:
                    last = line[-1]
                    line[-1] = Segment(last.text.rstrip(), last.style)
                yield from line
                yield Segment.line()

        def __rich_measure__(self, console: Any, options: Any) -> Any:
            if piped(console):
                options = options.update_width(max(options.max_width, PIPE_WIDTH))
            return super().__rich_measure__(console, options)

    return PipeTable


def registry() -> Any:
    """The process-wide registry."""
    from llmkit.registry import get_registry

    return get_registry()


#: The plugins this command has warned about (``main()`` clears it): one line each, once.
_warned: set[str] = set()


def reset_warnings() -> None:
    """Start a command: no plugin warned about yet."""
    _warned.clear()


def warn_failures(reg: Any) -> None:
    """One warning line on stderr per plugin that failed (once per command)."""
    from rich.markup import escape

    for info in reg.failures():
        if info.name in _warned:
            continue
        _warned.add(info.name)
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
