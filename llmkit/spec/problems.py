"""The keys a spec accepts at a place, for the ``unknown key`` problems of
:func:`llmkit.errors.validation_problems`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def fields_at(model: Any, loc: tuple[Any, ...]) -> list[str]:
    """Field names of the pydantic model found at ``loc`` below ``model``."""
    import typing

    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        ann = fields[part].annotation
        candidates = [ann, *typing.get_args(ann)]
        nxt = None
        for c in candidates:
            for inner in [c, *typing.get_args(c)]:
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    nxt = inner
        if nxt is None:
            return []
        current = nxt
    return list(getattr(current, "model_fields", {}))
