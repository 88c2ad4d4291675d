"""The conformance suite (llmkit.testing) over every registered component, its dispatch to
the check each kind declares, and the checks every kind gets."""

from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel, Field, model_validator

import llmkit.testing
from llmkit.contracts import ComponentOptions, NoOptions
from llmkit.hookspecs import hookimpl
from llmkit.registry import get_registry
from llmkit.testing import check_component, check_generic, conformance_params
from tests.testing.fakes import (
    GADGET_CALLS,
    GADGET_CHECK,
    GoodFFN,
    MixingFFN,
    Pointwise,
    fake,
    fake_registry,
)

# -- every registered component -------------------------------------------------------------


@pytest.mark.parametrize("record", conformance_params())
def test_component_conforms(record):
    check_component(record)


# Option sets that exercise code paths the defaults do not reach.
BUILTIN_VARIANTS = [
    ("attention", "sliding_window", {"window": 1}),
    ("attention", "sliding_window", {"window": 3}),
    ("attention", "sliding_window", {"window": 40}),  # several query chunks
    ("attention", "dense", {"dropout": 0.1}),
    ("attention", "sdpa", {"dropout": 0.1}),
    ("attention", "dense", {"window": 3}),
    ("norm", "rmsnorm", {"offset": 1.0}),
    ("position", "alibi", {"max_bias": 16.0}),
    ("block", "sandwich", {"input_norms": False}),
    ("qk_transform", "rmsnorm", {"offset": 1.0, "eps": 1e-5}),
    ("position", "rope", {"rotary_fraction": 0.5}),
    ("position", "rope", {"scaling": "ntk", "scaling_factor": 4.0}),
    ("position", "rope", {"scaling": "linear", "scaling_factor": 2.0}),
    ("position", "sinusoidal", {"base": 100.0}),
    *[("ffn", "mlp", {"activation": a}) for a in ("gelu_tanh", "relu", "relu2", "silu")],
    ("ffn", "swiglu", {"bias": False, "multiple_of": 16}),
    ("ffn", "geglu", {"approximate": "tanh", "hidden": 24}),
    ("norm", "layernorm", {"bias": False}),
    ("optimizer", "sgd", {"nesterov": True}),
    ("optimizer", "adamw", {"weight_decay": 0.1}),
    ("schedule", "wsd", {"decay_shape": "cosine"}),
    ("schedule", "inverse_sqrt", {"timescale": 5}),
    ("schedule", "cosine", {"min_lr_ratio": 0.0}),
]


@pytest.mark.parametrize(
    ("kind", "name", "options"),
    BUILTIN_VARIANTS,
    ids=[f"{k}.{n}-{'-'.join(f'{a}={b}' for a, b in o.items())}" for k, n, o in BUILTIN_VARIANTS],
)
def test_builtin_variant_conforms(kind, name, options):
    check_component(get_registry().get(kind, name), options)


def test_conformance_params_ids_cover_the_registry():
    reg = get_registry()
    ids = [p.id for p in conformance_params(registry=reg)]
    assert ids == [c.key for c in reg.list()]
    norms = [p.id for p in conformance_params("norm", registry=reg)]
    assert {"norm.layernorm", "norm.rmsnorm"} <= set(norms)
    assert all(i.startswith("norm.") for i in norms)


# -- fake plugins -----------------------------------------------------------------------------


def test_fake_plugin_components_join_the_suite():
    reg = fake_registry(
        {"kind": "widget", "name": "gizmo", "target": lambda: None, "options": NoOptions},
        {"kind": "ffn", "name": "mixer", "target": MixingFFN},
    )
    ids = [p.id for p in conformance_params(registry=reg)]
    assert "widget.gizmo" in ids and "ffn.mixer" in ids and "attention.sdpa" in ids
    params = {p.id: p.values[0] for p in conformance_params(registry=reg)}
    assert params["ffn.mixer"].provider == "llmkit-fake"
    check_component(params["widget.gizmo"])  # unknown kinds: options and a callable target
    with pytest.raises(AssertionError, match="mixes positions"):
        check_component(params["ffn.mixer"])


def test_requires_cuda_is_skipped_without_a_gpu():
    reg = fake_registry(
        {
            "kind": "ffn",
            "name": "gpu_only",
            "target": GoodFFN,
            "capabilities": {"requires": ["cuda"]},
        }
    )
    (param,) = [p for p in conformance_params("ffn", registry=reg) if p.id == "ffn.gpu_only"]
    assert bool(param.marks) == (not torch.cuda.is_available())


# -- each kind's own check ----------------------------------------------------------------------


def test_builtin_kinds_declare_their_checks():
    kinds = get_registry().kinds
    for name in (
        "attention", "ffn", "norm", "position", "optimizer", "schedule", "block",
        "qk_transform", "dataset", "adapter", "logger",
    ):  # fmt: skip
        assert kinds[name].load_check() is getattr(llmkit.testing, f"check_{name}")
    for kind in kinds.values():
        assert kind.check is None or callable(kind.load_check()), kind.name


def test_a_kind_without_a_check_gets_check_generic(monkeypatch):
    reg = fake_registry({"kind": "widget", "name": "gizmo", "target": 42, "options": NoOptions})
    assert reg.kinds["widget"].check is None
    seen = []

    def spy(record, options=None, *, device=None):
        seen.append(record.name)
        check_generic(record, options, device=device)

    monkeypatch.setattr("llmkit.testing.suite.check_generic", spy)
    with pytest.raises(AssertionError, match="is not callable"):  # check_generic's finding
        check_component(reg.get("widget", "gizmo"), registry=reg)
    assert seen == ["gizmo"]


def test_a_plugin_kind_with_a_check_gets_it_run():
    reg = fake_registry(
        {"kind": "gadget", "name": "good", "target": lambda: 42, "options": NoOptions},
        {"kind": "gadget", "name": "bad", "target": lambda: 41, "options": NoOptions},
        {"kind": "gadget", "name": "lax", "target": lambda: 42, "options": LaxOptions},
    )
    assert reg.kinds["gadget"].check == GADGET_CHECK
    GADGET_CALLS.clear()
    check_component(reg.get("gadget", "good"), registry=reg, device="cpu")
    assert GADGET_CALLS == [("good", None, "cpu")]
    check_generic(reg.get("gadget", "bad"))  # the generic check alone finds nothing wrong
    with pytest.raises(AssertionError, match="gadget 'bad': answered 41, must answer 42"):
        check_component(reg.get("gadget", "bad"), registry=reg)
    with pytest.raises(AssertionError, match="accepts unknown keys"):  # options come first
        check_component(reg.get("gadget", "lax"), registry=reg)


def test_a_check_that_does_not_import_is_reported():
    class BrokenKindPlugin:
        @hookimpl
        def register_kinds(self, register):
            register("doohickey", "Its check is missing", check="tests.testing.fakes:no_check")

        @hookimpl
        def register_components(self, register):
            register("doohickey", "thing", lambda: None, options=NoOptions)

    reg = fake_registry()
    assert reg.add_plugin(BrokenKindPlugin(), "broken", "llmkit-broken", "0").error is None
    with pytest.raises(
        AssertionError,
        match=r"doohickey 'thing' \(from llmkit-broken\): the conformance check of kind "
        r"'doohickey' \(tests.testing.fakes:no_check, from llmkit-broken\) failed to import",
    ):
        check_component(reg.get("doohickey", "thing"), registry=reg)


# -- other kinds ------------------------------------------------------------------------------


class NeedsPath(ComponentOptions):
    path: str = Field(description="required")


class LaxOptions(BaseModel):
    """Silently accepts unknown keys."""

    size: int = 1


class NeverValid(ComponentOptions):
    size: int = 1

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError("never valid")


def test_unknown_kind_checks_options_and_target():
    # required options (a dataset's paths) are fine without options; validated when given
    check_component(fake("widget", lambda: None, options=NeedsPath))
    check_component(fake("widget", lambda: None, options=NeedsPath), {"path": "x"})
    with pytest.raises(AssertionError, match="do not validate"):
        check_component(fake("widget", lambda: None, options=NeedsPath), {"path": 3.5})
    with pytest.raises(AssertionError, match="default options do not validate"):
        check_component(fake("widget", lambda: None, options=NeverValid))
    with pytest.raises(AssertionError, match="accepts unknown keys"):
        check_component(fake("widget", lambda: None, options=LaxOptions))
    with pytest.raises(AssertionError, match="accepts unknown keys"):
        check_component(fake("ffn", GoodFFN, options=LaxOptions))
    with pytest.raises(AssertionError, match="not callable"):
        check_component(fake("widget", 42, options=NoOptions))
    with pytest.raises(AssertionError, match="failed to import"):
        check_component(fake("widget", "llmkit.no_such_module:thing", options=NoOptions))


def test_unbuildable_component_is_an_assertion_not_a_crash():
    class Crashing(Pointwise):
        def __init__(self, options, ctx):
            raise RuntimeError("boom")

    with pytest.raises(AssertionError, match=r"building it .* raised RuntimeError: boom"):
        check_component(fake("ffn", Crashing))
