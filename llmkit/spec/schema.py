"""JSON Schema of the whole spec, with one branch per registered component.

Each component reference becomes a union of the registered components of its kind,
discriminated by ``name``, each branch carrying that component's own options, so an
editor validates and completes spec files.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, create_model

from llmkit.spec import DEFAULT_COMPONENTS, DataSpec, LayerOverride, ModelSpec, Spec

KINDS = ("attention", "ffn", "norm", "position", "optimizer", "schedule", "dataset")


def _ident(text: str) -> str:
    return re.sub(r"\W", "_", text)


def ref_type(registry: Any, kind: str) -> Any:
    """A discriminated union of every registered component of ``kind``."""
    branches = []
    for rec in registry.list(kind):
        opts = rec.options_model()
        branch = create_model(
            f"{_ident(kind)}__{_ident(rec.name)}",
            __base__=opts,
            __doc__=rec.summary or None,
            name=(Literal[rec.name], Field(description=f"{kind} component {rec.name!r}")),
        )
        branches.append(branch)
    if not branches:
        raise ValueError(f"no component of kind {kind!r} is registered")
    if len(branches) == 1:
        return branches[0]
    return Annotated[Union[tuple(branches)], Field(discriminator="name")]  # noqa: UP007


def spec_schema(registry: Any) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a spec file, after ``extends`` is applied."""
    refs = {kind: ref_type(registry, kind) for kind in KINDS if kind in registry.kinds}
    slot = {k: refs[k] for k in ("attention", "ffn", "norm", "position")}
    dflt = DEFAULT_COMPONENTS
    override = create_model(
        "LayerOverride",
        __base__=LayerOverride,
        **{k: (v | None, None) for k, v in slot.items()},
    )
    model = create_model(
        "ModelSpec",
        __base__=ModelSpec,
        overrides=(list[override], Field(default_factory=list)),
        **{k: (v, Field(default={"name": dflt[k]})) for k, v in slot.items()},
    )
    data = DataSpec
    if "dataset" in refs:
        data = create_model(
            "DataSpec",
            __base__=DataSpec,
            source=(refs["dataset"], Field(default={"name": dflt["source"]})),
        )
    spec = create_model(
        "Spec",
        __base__=Spec,
        model=(model, ...),
        optimizer=(refs["optimizer"], Field(default={"name": "adamw"})),
        schedule=(refs["schedule"], Field(default={"name": "cosine"})),
        data=(data, Field(default_factory=dict)),
    )
    schema = spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "llmkit spec"
    return schema
