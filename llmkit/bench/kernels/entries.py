"""What is benchmarked: entries (a registered component with its options), building them, and
the one trial call that tells whether a component can run a case."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from llmkit.bench.kernels.timing import free, sync
from llmkit.contracts import BuildContext
from llmkit.errors import first_line


class Unsupported(Exception):
    """A component that cannot run a case; the message says why (the record is skipped)."""


@dataclass
class Entry:
    """One line of a comparison: a registered component, the options to build it with, and
    an optional context manager every call runs in (e.g. forcing an SDPA backend)."""

    label: str
    record: Any  # llmkit.registry.Component
    options: dict[str, Any] = field(default_factory=dict)
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None


@dataclass
class Prepared:
    """A ready-to-time call of one component on one case."""

    step: Callable[[], Any]
    flops: float | None
    bytes_moved: float | None
    info: dict[str, Any]


def entries(
    kind: str,
    names: Sequence[str] | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    registry: Any = None,
) -> list[Entry]:
    """Entries for ``names`` (default: every registered component of ``kind``, in registry
    order). Unknown names raise the registry's error (with a did-you-mean)."""
    if registry is None:
        from llmkit.registry import get_registry

        registry = get_registry()
    options = options or {}
    records = [registry.get(kind, n) for n in names] if names else registry.list(kind)
    return [Entry(r.name, r, dict(options.get(r.name, {}))) for r in records]


def check_capabilities(entry: Entry, device: str, causal: bool = True) -> None:
    """Raise Unsupported when the component's capabilities rule the case out
    (``requires = ["cuda"]`` off a GPU, ``causal_only`` for a non-causal case)."""
    caps = dict(getattr(entry.record, "capabilities", None) or {})
    for req in caps.get("requires", []):
        if req == "cuda" and device != "cuda":
            raise Unsupported("requires cuda")
    if not causal and caps.get("causal_only"):
        raise Unsupported("causal only (capability causal_only)")


def build(entry: Entry, ctx: BuildContext, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The entry's module on ``device`` in ``dtype``; options that do not validate (e.g. a
    required option without a value) raise Unsupported."""
    try:
        opts = entry.record.parse_options(entry.options)
    except Exception as exc:
        what = "default options" if not entry.options else f"options {entry.options!r}"
        raise Unsupported(f"{what} do not validate: {first_line(exc, typed=True)}") from exc
    module = entry.record.load()(opts, ctx)
    return module.to(device=device, dtype=dtype)


def pop_side_outputs(module: torch.nn.Module) -> None:
    """Drop what a component reported (auxiliary losses, metrics) during a call."""
    pop = getattr(module, "pop_side_outputs", None)
    if callable(pop):
        pop()


def wrap(entry: Entry, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run inside the entry's context, if it has one."""
    if entry.context is None:
        return fn
    context = entry.context

    def step() -> Any:
        with context():
            return fn()

    return step


def trial(step: Callable[[], Any], device: str) -> None:
    """One call; the exceptions that mean "cannot run this case" become Unsupported."""
    try:
        step()
        sync(device)
    except torch.OutOfMemoryError as exc:
        free(device)
        raise Unsupported("out of memory") from exc
    except (NotImplementedError, ValueError) as exc:
        raise Unsupported(first_line(exc, typed=True)) from exc
