"""The resolved form of a spec: every component table bound to its registry record."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from llmkit.spec.models import ModelSpec, Spec
from llmkit.spec.sections import set_at


@dataclass
class Resolved:
    """A component reference resolved to its registry record and validated options."""

    kind: str
    record: Any  # llmkit.registry.Component
    options: Any  # the component's Options instance

    @property
    def name(self) -> str:
        return self.record.name

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.options.model_dump(mode="json")}

    def build(self, *args: Any, **kwargs: Any) -> Any:
        return self.record.load()(*args, **kwargs)


@dataclass
class MixturePart:
    """One source of ``data.mixture``: its name, its weight as written, its source."""

    name: str
    weight: float
    source: Resolved


class LayerPlan:
    """The components of one layer by slot: ``attention``, ``ffn``, ``norm``, ``position``
    and any per-layer kind a plugin declares, each readable as an attribute."""

    def __init__(self, slots: dict[str, Resolved] | None = None, **named: Resolved) -> None:
        self.slots: dict[str, Resolved] = {**(slots or {}), **named}

    def __getattr__(self, name: str) -> Resolved:
        slots = self.__dict__.get("slots", {})
        if name in slots:
            return slots[name]
        raise AttributeError(f"this layer has no {name!r} component (slots: {', '.join(slots)})")

    def get(self, slot: str) -> Resolved | None:
        """The layer's component in ``slot``, or None when no kind has that slot."""
        return self.slots.get(slot)

    def __repr__(self) -> str:
        return f"LayerPlan({', '.join(f'{k}={v.name}' for k, v in self.slots.items())})"


@dataclass
class ResolvedSpec:
    """The spec with every component resolved, and the component of every layer.

    ``model_slots`` holds the model-wide choice of each per-layer kind (``position`` is the
    embedding-site scheme, ``norm`` the final norm); ``components`` holds every other kind's
    component by its spec section (``"optimizer"``, ``"data.source"``, ``"train.loss"``).
    """

    spec: Spec
    layers: list[LayerPlan]
    model_slots: dict[str, Resolved]
    components: dict[str, Resolved]
    source: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)
    #: ``train.loggers``, resolved (kind ``logger``), in the spec's order.
    loggers: list[Resolved] = field(default_factory=list)
    #: ``data.mixture``, resolved (kind ``dataset``), in the spec's order; empty without one.
    mixture: list[MixturePart] = field(default_factory=list)

    @property
    def model(self) -> ModelSpec:
        return self.spec.model

    @property
    def position(self) -> Resolved:
        return self.model_slots["position"]

    @property
    def norm(self) -> Resolved:
        return self.model_slots["norm"]

    @property
    def optimizer(self) -> Resolved:
        return self.components["optimizer"]

    @property
    def schedule(self) -> Resolved:
        return self.components["schedule"]

    @property
    def dataset(self) -> Resolved | None:
        return self.component("dataset")

    def with_source(self, source: Resolved) -> ResolvedSpec:
        """A copy whose ``data.source`` is ``source`` and which has no mixture: one part of
        a mixture, prepared as a spec of its own."""
        components = {k: v for k, v in self.components.items() if v.kind != "dataset"}
        components["data.source"] = source  # the dataset kind's section
        raw = copy.deepcopy(self.raw)
        data = raw.setdefault("data", {})
        data.pop("mixture", None)
        data["source"] = source.to_dict()
        spec = self.spec.model_copy(
            update={"data": self.spec.data.model_copy(update={"mixture": []})}
        )
        return dataclasses.replace(self, spec=spec, raw=raw, components=components, mixture=[])

    def component(self, kind: str) -> Resolved | None:
        """The spec's component of a kind that is not chosen per layer (None if absent)."""
        return next((r for r in self.components.values() if r.kind == kind), None)

    def with_vocab_size(self, n: int) -> ResolvedSpec:
        """A copy whose model has ``n`` token embeddings — the tokenizer's actual size — in
        ``spec`` and ``raw`` alike. Nothing is resolved again: no component's options or
        check depends on the vocabulary, which is only read when the model is built."""
        if n <= 0:
            raise ValueError(f"vocab_size must be positive, not {n}")
        raw = copy.deepcopy(self.raw)
        raw.setdefault("model", {})["vocab_size"] = n
        model = self.spec.model.model_copy(update={"vocab_size": n})
        spec = self.spec.model_copy(update={"model": model})
        return dataclasses.replace(self, spec=spec, raw=raw)

    def with_settings(self, settings: dict[str, Any]) -> ResolvedSpec:
        """A copy with plain settings ``{"table.field": value}`` (``train.init_from``,
        ``tokenizer.kind``…) changed in ``spec`` and ``raw`` alike; as
        :meth:`with_vocab_size`, for values the trainer settles, not the user's choices,
        so nothing is validated or resolved again."""
        raw = copy.deepcopy(self.raw)
        spec = self.spec
        for path, value in settings.items():
            table, _, name = path.partition(".")
            sub = getattr(spec, table, None)
            if sub is None or not name or name not in type(sub).model_fields:
                raise ValueError(f"{path} is not a plain spec setting")
            raw_value = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
            raw.setdefault(table, {})[name] = raw_value
            spec = spec.model_copy(update={table: sub.model_copy(update={name: value})})
        return dataclasses.replace(self, spec=spec, raw=raw)

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved spec: defaults filled, one entry per layer."""
        out = self.spec.model_dump(mode="json", exclude={"extends"}, exclude_none=True)
        m = out["model"]
        for slot, res in self.model_slots.items():
            m[slot] = res.to_dict()
        m["n_kv_heads"] = self.model.kv_heads
        m["head_dim"] = self.model.dim_head
        m["layers"] = [{s: r.to_dict() for s, r in plan.slots.items()} for plan in self.layers]
        m.pop("overrides", None)
        for section, res in self.components.items():
            set_at(out, section, res.to_dict())
        if self.loggers:
            out["train"]["loggers"] = [res.to_dict() for res in self.loggers]
        if self.mixture:
            out["data"]["mixture"] = [
                {"name": p.name, "source": p.source.to_dict(), "weight": p.weight}
                for p in self.mixture
            ]
            out["data"].pop("source", None)
        return out
