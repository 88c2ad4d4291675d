"""The suite over the registry: :func:`check_component` runs the check a component's kind
declares (the ``check`` field of its :class:`~llmkit.registry.Kind`), and
:func:`conformance_params` parametrizes a test over every registered component."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from llmkit.testing.common import Options, Record, _capabilities, _expect, _fail
from llmkit.testing.generic import check_generic, check_options_model
from llmkit.testing.parallel_plan import PLANNED_KINDS, check_parallel_plan


def _kind_check(record: Record, registry: Any) -> Callable[..., None]:
    """The check ``record``'s kind declares in ``registry``; :func:`check_generic` for a kind
    that declares none or that ``registry`` does not know."""
    kind = getattr(record, "kind_record", None)
    if kind is None and registry is not None:
        kind = registry.kinds.get(record.kind)
    if kind is None or not kind.check:
        return check_generic
    what = f"the conformance check of kind {kind.name!r} ({kind.check}, from {kind.provider})"
    try:
        check = kind.load_check()
    except Exception as exc:
        _fail(record, f"{what} failed to import: {type(exc).__name__}: {exc}")
    _expect(callable(check), record, f"{what} is not callable")
    return check


def check_component(
    record: Record,
    options: Options = None,
    *,
    device: str | torch.device | None = None,
    registry: Any = None,
) -> None:
    """Check ``record`` (with ``options``, default: its defaults): :func:`check_options_model`,
    then the check its kind declares (``register_kinds(..., check="module:attr")``), or
    :func:`check_generic` for a kind that declares none.

    The kind is the one the record was registered under (``record.kind_record``); for a
    record made by hand it is looked up in ``registry`` (default: llmkit's process registry).
    Raises AssertionError naming the component and the broken property.
    """
    if registry is None and getattr(record, "kind_record", None) is None:
        from llmkit.registry import get_registry

        registry = get_registry()
    check_options_model(record, options)
    _kind_check(record, registry)(record, options, device=device)
    if record.kind in PLANNED_KINDS:  # a declared tensor-parallel plan is well formed
        from llmkit.testing.common import _build_module, small_context

        module = _build_module(record, options, small_context(), torch.device("cpu"))
        check_parallel_plan(record, module)


def _unmet_requirements(record: Record) -> list[str]:
    unmet = []
    for req in _capabilities(record).get("requires", []):
        if req == "cuda" and not torch.cuda.is_available():
            unmet.append("cuda")
    return unmet


def conformance_params(kind: str | None = None, registry: Any = None) -> list[Any]:
    """``pytest.param(record, id="kind.name")`` for every registered component (of ``kind``),
    built-in or from a plugin; components whose ``requires`` cannot be met here are skipped.
    Records from a ``registry`` of your own: pass it to :func:`check_component` too."""
    import pytest

    if registry is None:
        from llmkit.registry import get_registry

        registry = get_registry()
    params = []
    for record in registry.list(kind):
        unmet = _unmet_requirements(record)
        marks = [pytest.mark.skip(reason=f"requires {', '.join(unmet)}")] if unmet else []
        params.append(pytest.param(record, id=f"{record.kind}.{record.name}", marks=marks))
    return params
