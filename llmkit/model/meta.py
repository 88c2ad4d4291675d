"""Models on the meta device: shapes and dtypes only, no memory, no values.

Spec checks, parameter counts and FLOP accounting build the model there before (or instead
of) building it for real. Ops without a C++ meta kernel (``arange`` in float64, ``normal_``)
run torch's Python decompositions on the meta device, and some of those are wrapped to keep
``torch._dynamo`` from tracing them; the wrapper imports dynamo on its first call, 1–2 s
with sympy, which a command that compiles nothing never needs otherwise.

Nothing can be traced while dynamo is not imported, so :func:`meta_device` lets those
wrappers call their function directly: for the build, ``torch._dynamo`` is a stand-in whose
``disable(fn)`` is ``fn``. Afterwards the stand-in is removed and the wrappers forget what it
gave them, so a later call (once dynamo is really imported) wraps as torch intends. If the
build asks the stand-in for anything else, :func:`build_on_meta` builds again with the real
dynamo.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: The attribute torch's lazy ``_disable_dynamo`` wrapper caches its wrapped function in.
CACHE_ATTR = "__dynamo_disable"


class DynamoStandIn(types.ModuleType):
    """``torch._dynamo`` while a model is built on the meta device without it."""

    def __init__(self) -> None:
        super().__init__("torch._dynamo")
        #: Functions whose wrapper called :meth:`disable` (their cache is cleared on exit).
        self.given: list[Callable[..., Any]] = []
        #: Names asked for that the stand-in does not have.
        self.missing: list[str] = []

    def disable(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        self.given.append(fn)
        return fn

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__"):
            self.missing.append(name)
        raise AttributeError(name)


@contextmanager
def meta_device() -> Iterator[DynamoStandIn | None]:
    """Create tensors on the meta device; while ``torch._dynamo`` is not imported, with the
    stand-in in its place (yielded; None when dynamo is already imported)."""
    if "torch._dynamo" in sys.modules:
        with torch.device("meta"):
            yield None
        return
    stand_in = DynamoStandIn()
    sys.modules["torch._dynamo"] = stand_in
    try:
        with torch.device("meta"):
            yield stand_in
    finally:
        if sys.modules.get("torch._dynamo") is stand_in:
            del sys.modules["torch._dynamo"]
        if torch.__dict__.get("_dynamo") is stand_in:
            del torch._dynamo
        for fn in stand_in.given:
            if getattr(fn, CACHE_ATTR, None) is fn:
                delattr(fn, CACHE_ATTR)
