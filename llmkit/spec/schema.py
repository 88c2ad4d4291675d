"""JSON Schema of the whole spec, with one branch per registered component.

Each component reference becomes a union of the registered components of its kind,
discriminated by ``name``, each branch carrying that component's own options, so an
editor validates and completes spec files.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, create_model

from llmkit.spec.models import TrainSpec
from llmkit.spec.resolve import LOGGER_KIND
from llmkit.spec.sections import spec_model


def _ident(text: str) -> str:
    return re.sub(r"\W", "_", text)


def ref_type(registry: Any, kind: str, default: str | None = None) -> Any:
    """A union of every registered component of ``kind``, told apart by ``name``; the
    ``default`` component's branch also takes a table without ``name`` (as the loader
    does), so the union is not a discriminated one then."""
    branches = []
    for rec in registry.list(kind):
        opts = rec.options_model()
        desc = f"{kind} component {rec.name!r}"
        name_field = (
            Field(rec.name, description=desc) if rec.name == default else Field(description=desc)
        )
        branch = create_model(
            f"{_ident(kind)}__{_ident(rec.name)}",
            __base__=opts,
            __doc__=rec.summary or None,
            name=(Literal[rec.name], name_field),
        )
        branches.append(branch)
    if not branches:
        raise ValueError(f"no component of kind {kind!r} is registered")
    if len(branches) == 1:
        return branches[0]
    if default is not None:
        return Union[tuple(branches)]  # noqa: UP007
    return Annotated[Union[tuple(branches)], Field(discriminator="name")]  # noqa: UP007


def spec_schema(registry: Any) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a spec file, after ``extends`` is applied: one
    table per kind's section, each a union of that kind's registered components (a kind
    with no component yet has no table)."""

    def ref(kind: Any, optional: bool) -> tuple[Any, Any] | None:
        if not registry.list(kind.name):
            return None  # no component could be written there yet
        union = ref_type(registry, kind.name, kind.default)
        desc = f"{kind.summary} (see `llmkit list {kind.name}`)."
        if optional:
            return union | None, Field(None, description=desc)
        return union, Field(default={"name": kind.default}, description=desc)

    extra: dict[str, dict[str, Any]] = {}
    if registry.list(LOGGER_KIND):  # train.loggers: a list of any registered logger
        loggers = Field(
            default_factory=list, description=TrainSpec.model_fields["loggers"].description
        )
        extra["train"] = {"loggers": (list[ref_type(registry, LOGGER_KIND)], loggers)}  # type: ignore[misc]
    spec = spec_model(registry, ref, prefix="Schema", extra=extra)
    schema = spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "llmkit spec"
    return schema
