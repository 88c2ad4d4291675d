"""Kinds own their spec sections: a kind a plugin declares gets a spec table (optional or
defaulted, model-wide or per layer), pass-one errors and a JSON Schema branch for free."""

from __future__ import annotations

import pytest
from pydantic import Field

from llmkit import hookimpl
from llmkit.contracts import ComponentOptions
from llmkit.errors import SpecError
from llmkit.spec import load_spec_dict
from llmkit.spec.schema import spec_schema
from tests.helpers import registry_with, tiny_spec


class WeightedOptions(ComponentOptions):
    weight: float = Field(1.0, gt=0)


class Widget:
    """A stand-in component."""

    Options = WeightedOptions


class KindPlugin:
    """Declares a ``loss`` kind chosen at ``train.loss`` (optional) and a per-layer
    ``mixer`` kind at ``model.mixer`` (default ``plain``)."""

    def __init__(self, **loss_fields):
        self.loss_fields = loss_fields

    @hookimpl
    def register_kinds(self, register):
        register("loss", "Training objective", section="train.loss", **self.loss_fields)
        register("mixer", "Token mixer", section="model.mixer", default="plain", per_layer=True)

    @hookimpl
    def register_components(self, register):
        for kind, name in [("loss", "xent"), ("loss", "z"), ("mixer", "plain"), ("mixer", "fancy")]:
            register(kind, name, Widget, summary=f"{kind} {name}")


def test_an_optional_section_is_absent_until_written():
    reg = registry_with(KindPlugin())
    rs = load_spec_dict(tiny_spec(), registry=reg)
    assert rs.component("loss") is None
    assert "loss" not in rs.to_dict()["train"]
    rs = load_spec_dict(
        {**tiny_spec(), "train": {"loss": {"name": "z", "weight": 0.5}}}, registry=reg
    )
    assert rs.component("loss").name == "z"
    assert rs.component("loss").options.weight == 0.5
    assert rs.components["train.loss"] is rs.component("loss")
    assert rs.to_dict()["train"]["loss"] == {"name": "z", "weight": 0.5}


def test_a_defaulted_section_is_filled_in():
    reg = registry_with(KindPlugin(default="xent"))
    rs = load_spec_dict(tiny_spec(), registry=reg)
    assert rs.component("loss").name == "xent"
    assert rs.raw["train"]["loss"] == {"name": "xent"}


def test_section_options_are_checked_by_the_component_with_the_full_path():
    reg = registry_with(KindPlugin())
    with pytest.raises(SpecError) as err:
        load_spec_dict({**tiny_spec(), "train": {"loss": {"name": "z", "wieght": 1}}}, registry=reg)
    assert "train.loss.wieght: unknown option for loss 'z'; did you mean 'weight'?" in str(
        err.value
    )
    with pytest.raises(SpecError, match=r"train.loss.name: unknown loss 'q'"):
        load_spec_dict({**tiny_spec(), "train": {"loss": {"name": "q"}}}, registry=reg)


def test_without_the_kind_the_section_is_an_unknown_key():
    with pytest.raises(SpecError, match=r"train.loss: unknown key"):
        load_spec_dict({**tiny_spec(), "train": {"loss": {"name": "z"}}}, registry=registry_with())


def test_a_per_layer_kind_is_chosen_model_wide_and_per_layer():
    reg = registry_with(KindPlugin())
    spec = tiny_spec(n_layers=3, overrides=[{"layers": [-1], "mixer": {"name": "fancy"}}])
    rs = load_spec_dict(spec, registry=reg)
    assert [plan.mixer.name for plan in rs.layers] == ["plain", "plain", "fancy"]
    assert rs.layers[0].get("mixer").kind == "mixer"
    assert rs.model_slots["mixer"].name == "plain"
    assert [layer["mixer"]["name"] for layer in rs.to_dict()["model"]["layers"]] == [
        "plain",
        "plain",
        "fancy",
    ]


def test_the_schema_has_a_branch_for_every_kind_section():
    schema = spec_schema(registry_with(KindPlugin()))
    text = str(schema)
    assert "loss__z" in text and "mixer__fancy" in text
    defs = schema["$defs"]
    train = next(v for k, v in defs.items() if k.endswith("TrainSpec"))
    assert "loss" in train["properties"]
    model = next(v for k, v in defs.items() if k.endswith("ModelSpec"))
    assert model["properties"]["mixer"]["default"] == {"name": "plain"}


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("nowhere.loss", "is not inside a spec table"),
        ("train.batch_size", "is already a spec setting"),
        ("model", "is already a spec setting"),
    ],
)
def test_a_section_that_cannot_be_placed_is_refused(section, message):
    class Bad:
        @hookimpl
        def register_kinds(self, register):
            register("loss", "Training objective", section=section)

    with pytest.raises(SpecError, match=message):
        load_spec_dict(tiny_spec(), registry=registry_with(Bad()))


def test_a_section_taken_by_another_kind_is_refused_at_registration():
    class Twice:
        @hookimpl
        def register_kinds(self, register):
            register("loss2", "Another objective", section="optimizer")

    reg = registry_with(Twice())
    (failed,) = reg.failures()
    assert "section 'optimizer' is already kind 'optimizer'" in failed.error


def test_an_optional_per_layer_kind_fills_only_the_layers_that_name_it():
    class Optional:
        @hookimpl
        def register_kinds(self, register):
            register("hook", "A q/k transform", section="model.hook", per_layer=True)

        @hookimpl
        def register_components(self, register):
            register("hook", "on", Widget)

    reg = registry_with(Optional())
    spec = tiny_spec(n_layers=3, overrides=[{"layers": "1:", "hook": {"name": "on"}}])
    rs = load_spec_dict(spec, registry=reg)
    assert [plan.get("hook") and plan.hook.name for plan in rs.layers] == [None, "on", "on"]
    assert "hook" not in rs.model_slots
    assert "hook" not in rs.to_dict()["model"]["layers"][0]
