"""Two-pass resolution: the outer structure (pass one), then every component table against
its registry record's own options model (pass two), then cross-component checks.

Every problem is reported at once, each with its full path (``model.attention.window``).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from llmkit.errors import RegistryError, SpecError, validation_problems
from llmkit.spec.files import apply_override, load_raw
from llmkit.spec.limits import recipe_problems, size_problems
from llmkit.spec.models import (
    MAX_LAYERS,
    ComponentRef,
    LayerSelector,
    ModelSpec,
    Spec,
    is_layer_selector,
)
from llmkit.spec.problems import fields_at
from llmkit.spec.resolved import LayerPlan, MixturePart, Resolved, ResolvedSpec
from llmkit.spec.sections import (
    cached_spec_model,
    default_names,
    get_at,
    layer_kinds,
    set_at,
    spec_kinds,
)


def load_spec(
    path: str | Path, overrides: list[str] | None = None, registry: Any = None
) -> ResolvedSpec:
    """Load, merge, override, validate and resolve a spec file; then check it as a training
    recipe (:func:`llmkit.spec.limits.recipe_problems`: what training would refuse before
    reading data), which in-memory specs describing only a model are spared."""
    data = load_raw(path)
    for assignment in overrides or []:
        apply_override(data, assignment)
    rs = resolve(data, source=str(path), registry=registry)
    problems = recipe_problems(rs)
    if problems:
        raise SpecError(problems, str(path))
    return rs


def load_spec_dict(
    data: dict[str, Any], overrides: list[str] | None = None, registry: Any = None
) -> ResolvedSpec:
    """Like :func:`load_spec` for an in-memory dict (no ``extends`` from files)."""
    data = copy.deepcopy(data)
    for assignment in overrides or []:
        apply_override(data, assignment)
    return resolve(data, source=None, registry=registry)


#: The kind of ``train.loggers``' entries (a list, so the kind has no section of its own).
LOGGER_KIND = "logger"


def select_layers(selector: LayerSelector, n_layers: int) -> list[int]:
    """Indices chosen by a list (negatives count from the end) or a slice string."""
    if isinstance(selector, list):
        out = []
        for i in selector:
            j = i + n_layers if i < 0 else i
            if not 0 <= j < n_layers:
                raise ValueError(f"layer {i} is out of range for {n_layers} layers")
            out.append(j)
        return sorted(set(out))
    parts = selector.split(":")
    if len(parts) > 3:
        raise ValueError(f"bad layer slice {selector!r}: use 'start:stop:step'")
    try:
        nums = [int(p) if p.strip() else None for p in parts]
    except ValueError as exc:
        raise ValueError(f"bad layer slice {selector!r}: use 'start:stop:step'") from exc
    if len(nums) == 1:  # a single index given as a string
        return select_layers([nums[0]], n_layers) if nums[0] is not None else []
    if len(nums) == 3 and nums[2] == 0:
        raise ValueError(f"bad layer slice {selector!r}: step must not be 0")
    return list(range(n_layers))[slice(*nums)]


class _Resolver:
    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self.problems: list[str] = []

    def ref(self, kind: str, raw: Any, path: str) -> Resolved | None:
        if isinstance(raw, ComponentRef):
            raw = {"name": raw.name, **raw.options}
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            return None  # pass one reports it
        options = {k: v for k, v in raw.items() if k != "name"}
        try:
            record = self.registry.get(kind, raw["name"])
        except RegistryError as exc:
            self.problems.append(f"{path}.name: {exc}")
            return None
        try:
            model = record.options_model()
            opts = model.model_validate(options)
        except ValidationError as exc:
            what = f"option for {kind} {record.name!r}"
            self.problems += validation_problems(
                exc,
                prefix=path.split("."),
                allowed=lambda loc: fields_at(model, loc[:-1]),
                what=what,
            )
            return None
        except RegistryError as exc:  # the component failed to import
            self.problems.append(f"{path}: {exc}")
            return None
        return Resolved(kind, record, opts)


def _plugins_switched_off(distribution: str, registry: Any) -> list[str]:
    """The llmkit plugins ``distribution`` provides when none of them is in ``registry``
    (switched off by ``LLMKIT_PLUGINS``); empty when one is there or it provides none."""
    import importlib.metadata as md

    loaded = getattr(registry, "plugins", None)
    if loaded is None:
        return []
    from llmkit.hookspecs import PROJECT

    names = sorted(
        ep.name for ep in md.distribution(distribution).entry_points if ep.group == PROJECT
    )
    return [] if any(n in loaded for n in names) else names


def _check_requires(requires: Any, source: str | None, registry: Any = None) -> None:
    if not isinstance(requires, list) or not requires:  # nothing to check: no packaging import
        return
    import importlib.metadata as md

    from packaging.requirements import InvalidRequirement, Requirement

    problems = []
    for item in requires:
        try:
            req = Requirement(str(item))
        except InvalidRequirement as exc:
            problems.append(f"requires: {item!r} is not a valid requirement ({exc})")
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            problems.append(f"requires: {req} is not installed (pip install '{req}')")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"requires: {req} but {req.name} {have} is installed")
            continue
        off = _plugins_switched_off(req.name, registry)
        if off:
            problems.append(
                f"requires: {req.name} is installed but its plugin {', '.join(off)} is not "
                f"loaded: LLMKIT_PLUGINS={os.environ.get('LLMKIT_PLUGINS', '')!r} leaves it out"
            )
    if problems:
        raise SpecError(problems, source)


def resolve(data: dict[str, Any], source: str | None = None, registry: Any = None) -> ResolvedSpec:
    """Validate a merged spec dict in two passes and resolve every component."""
    if registry is None:
        from llmkit.registry import get_registry

        registry = get_registry()
    data = copy.deepcopy(data)
    data.pop("extends", None)
    _check_requires(data.get("requires", []), source, registry)
    problems: list[str] = _norm_placement_block(data, registry)
    default_names(data, registry)
    if isinstance(data.get("data"), dict) and data["data"].get("mixture"):
        # a mixture names its sources: data.source (the default, or a base spec's) is unused
        data["data"].pop("source", None)
    spec_cls = cached_spec_model(registry)

    spec: Spec | None = None
    try:
        spec = spec_cls.model_validate(data)
    except ValidationError as exc:
        found = validation_problems(exc, allowed=lambda loc: fields_at(spec_cls, loc[:-1]))
        hint = getattr(registry, "failure_hint", None)  # a table a failed plugin's kind adds
        if hint is not None:
            found = [f"{p}{hint()}" if ": unknown key" in p else p for p in found]
        problems += found

    r = _Resolver(registry)
    raw_model = data.get("model") if isinstance(data.get("model"), dict) else {}
    slots = {k.slot: k.name for k in layer_kinds(registry)}
    base = {s: r.ref(kind, raw_model.get(s), f"model.{s}") for s, kind in slots.items()}
    components: dict[str, Resolved | None] = {}
    for kind in spec_kinds(registry):
        raw = get_at(data, kind.section)
        if not kind.per_layer and raw is not None:
            components[kind.section] = r.ref(kind.name, raw, kind.section)

    raw_loggers = get_at(data, "train.loggers")
    loggers = [
        r.ref(LOGGER_KIND, raw, f"train.loggers[{i}]")
        for i, raw in enumerate(raw_loggers if isinstance(raw_loggers, list) else [])
    ]

    raw_data = data.get("data") if isinstance(data.get("data"), dict) else {}
    raw_mixture = raw_data.get("mixture")
    mixture: list[tuple[Any, Resolved | None]] = [
        (raw, r.ref("dataset", raw.get("source"), f"data.mixture[{i}].source"))
        for i, raw in enumerate(raw_mixture if isinstance(raw_mixture, list) else [])
        if isinstance(raw, dict)
    ]

    n_layers = raw_model.get("n_layers")
    if not isinstance(n_layers, int) or not 0 < n_layers <= MAX_LAYERS:
        n_layers = 0  # pass one reports it; no list of a billion layers is made here
    per_layer: list[dict[str, Resolved | None]] = [dict(base) for _ in range(max(n_layers, 0))]
    raw_overrides = raw_model.get("overrides", [])
    for i, ov in enumerate(raw_overrides if isinstance(raw_overrides, list) else []):
        if not isinstance(ov, dict) or not is_layer_selector(ov.get("layers")):
            continue  # pass one reports it
        path = f"model.overrides[{i}]"
        try:
            chosen = select_layers(ov["layers"], n_layers)
        except (ValueError, TypeError) as exc:
            r.problems.append(f"{path}.layers: {exc}")
            continue
        if not chosen:
            r.problems.append(f"{path}.layers: {ov['layers']!r} selects no layer of {n_layers}")
        for slot, kind in slots.items():
            if ov.get(slot) is None:
                continue
            res = r.ref(kind, ov[slot], f"{path}.{slot}")
            for j in chosen:
                per_layer[j][slot] = res
    problems += r.problems

    layers: list[LayerPlan] = []
    if spec is not None and not problems:
        for j, chosen_slots in enumerate(per_layer):
            plan = LayerPlan({s: v for s, v in chosen_slots.items() if v is not None})
            problems += _compatibility(plan, base["position"], j)  # type: ignore[arg-type]
            layers.append(plan)
        problems += _dimension_checks(spec.model, layers)
        block = spec.data.block_size
        if block is not None and block > spec.model.max_seq_len:
            problems.append(
                f"data.block_size: {block} exceeds model.max_seq_len ({spec.model.max_seq_len})"
            )
        problems += size_problems(spec, layers)
    if problems:
        raise SpecError(problems, source)
    assert spec is not None
    return ResolvedSpec(
        spec=spec,
        layers=layers,
        model_slots={s: v for s, v in base.items() if v is not None},
        components=components,  # type: ignore[arg-type]
        source=source,
        raw=data,
        loggers=[res for res in loggers if res is not None],
        mixture=[
            MixturePart(entry.label, entry.weight, res)
            for entry, (_, res) in zip(spec.data.mixture, mixture, strict=True)
            if res is not None
        ],
    )


#: ``model.norm_placement`` → the block it stands for (the field predates the ``block`` kind).
NORM_PLACEMENT_BLOCKS = {"pre": "pre_norm", "post": "post_norm"}


def _norm_placement_block(data: dict[str, Any], registry: Any) -> list[str]:
    """Keep ``model.norm_placement`` and the model-wide block in agreement, before defaults.

    Without a block name, ``norm_placement`` picks one (``"post"`` → ``post_norm``, ``"pre"``
    → ``pre_norm``); without ``norm_placement``, the block sets it (``"post"`` for
    ``post_norm``, else ``"pre"``), so the resolved spec round-trips. Both written and
    contradicting (``"post"`` with any other block, ``"pre"`` with ``post_norm``) is a problem
    naming both paths. Per-layer blocks in ``model.overrides`` are not affected.
    """
    kind = getattr(registry, "kinds", {}).get("block")
    model = data.get("model")
    if kind is None or not kind.section or not isinstance(model, dict):
        return []
    placement = model.get("norm_placement")
    if placement is not None and placement not in NORM_PLACEMENT_BLOCKS:
        return []  # pass one reports it
    table = get_at(data, kind.section)
    name = table.get("name") if isinstance(table, dict) else None
    if not isinstance(name, str):
        if placement is not None and (table is None or isinstance(table, dict)):
            implied = NORM_PLACEMENT_BLOCKS[placement]
            set_at(data, kind.section, {**(table or {}), "name": implied})
        return []
    if placement is None:
        model["norm_placement"] = "post" if name == NORM_PLACEMENT_BLOCKS["post"] else "pre"
        return []
    if (name == NORM_PLACEMENT_BLOCKS["post"]) != (placement == "post"):
        return [
            f"{kind.section}.name: block {name!r} contradicts model.norm_placement = "
            f"{placement!r} (which selects block {NORM_PLACEMENT_BLOCKS[placement]!r}); "
            "set only one of them (a spec this one extends may set norm_placement)"
        ]
    return []


def acts_on(position: Resolved) -> set[str]:
    return set(position.record.capabilities.get("acts_on", []))


def _compatibility(plan: LayerPlan, model_position: Resolved, j: int) -> list[str]:
    problems = []
    att, pos = plan.attention, plan.position
    sites = acts_on(pos)
    supported = set(att.record.capabilities.get("positions", ["embedding", "qk", "score_bias"]))
    missing = sites - supported
    if missing:
        problems.append(
            f"model.layers[{j}]: attention {att.name!r} does not support position "
            f"{pos.name!r} (it acts on {', '.join(sorted(missing))}; {att.name!r} supports "
            f"{', '.join(sorted(supported)) or 'none'})"
        )
    if pos is not model_position and "embedding" in sites:
        problems.append(
            f"model.layers[{j}].position: {pos.name!r} acts on the embeddings, so it can only "
            "be set model-wide, not per layer"
        )
    return problems


def _dimension_checks(m: ModelSpec, layers: list[LayerPlan]) -> list[str]:
    problems = []
    caps = [plan.attention.record.capabilities for plan in layers]
    if m.kv_heads != m.n_heads:
        for j, c in enumerate(caps):
            if c.get("gqa") is False:
                problems.append(
                    f"model.layers[{j}].attention: {layers[j].attention.name!r} does not "
                    f"support n_kv_heads ({m.kv_heads}) != n_heads ({m.n_heads})"
                )
    for j, c in enumerate(caps):
        dims = c.get("head_dims")
        if dims and m.dim_head not in dims:
            problems.append(
                f"model.layers[{j}].attention: {layers[j].attention.name!r} supports head "
                f"dims {dims}, not {m.dim_head}"
            )
    return problems
