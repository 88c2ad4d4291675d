"""What every kind is checked for, and all a kind without a check of its own gets."""

from __future__ import annotations

import torch

from llmkit.testing.common import (
    Options,
    Record,
    _expect,
    _fail,
    _load,
    _options_model,
    build_options,
)


def check_options_model(record: Record, options: Options = None) -> None:
    """The options model is a pydantic model that rejects unknown keys (so a misspelled
    option in a spec is an error, not silently ignored)."""
    model = _options_model(record)
    _expect(
        hasattr(model, "model_validate") and hasattr(model, "model_fields"),
        record,
        f"its options model {model!r} is not a pydantic model",
    )
    probe = {**dict(options or {}), "conformance_unknown_key": 1}
    try:
        model.model_validate(probe)
    except Exception as exc:
        errors = getattr(exc, "errors", lambda: [])()
        if any(e.get("type") == "extra_forbidden" for e in errors):
            return
    _fail(
        record,
        f"its options model {model.__name__} accepts unknown keys; forbid them "
        "(subclass llmkit.contracts.ComponentOptions)",
    )


def check_generic(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """For kinds without a dedicated check: the options model forbids unknown keys and
    validates ``options`` (or its defaults, unless it has required fields and no ``options``
    are given), and the target loads as a callable."""
    check_options_model(record, options)
    required = [n for n, f in _options_model(record).model_fields.items() if f.is_required()]
    if options or not required:
        build_options(record, options)
    _load(record)
