"""The JSON Schema covers every registered component and validates the example specs."""

from __future__ import annotations

import jsonschema
import pytest

from llmkit.registry import get_registry
from llmkit.spec import load_raw
from llmkit.spec.schema import _ident, spec_schema
from tests.conftest import SPECS


@pytest.fixture(scope="module")
def schema():
    return spec_schema(get_registry())


def _validator(schema):
    return jsonschema.Draft202012Validator(schema)


def test_one_branch_per_component(schema):
    defs = schema["$defs"]
    reg = get_registry()
    for rec in reg.list():
        key = f"{rec.kind}__{_ident(rec.name)}"
        assert key in defs, key
        assert defs[key]["properties"]["name"]["const"] == rec.name
        assert defs[key]["additionalProperties"] is False


@pytest.mark.parametrize(
    "path", sorted(SPECS.glob("*.toml")) + sorted(SPECS.glob("*.yaml")), ids=lambda p: p.name
)
def test_every_example_spec_validates_against_the_schema(schema, path):
    _validator(schema).validate(load_raw(path))


def test_schema_rejects_bad_component_options(schema):
    bad = {
        "model": {
            "d_model": 8,
            "n_layers": 1,
            "n_heads": 2,
            "attention": {"name": "sliding_window", "windw": 3},
        }
    }
    errors = list(_validator(schema).iter_errors(bad))
    assert errors
    bad["model"]["attention"] = {"name": "sliding_window", "window": 0}
    assert list(_validator(schema).iter_errors(bad))
    bad["model"]["attention"] = {"name": "nonexistent"}
    assert list(_validator(schema).iter_errors(bad))
    bad["model"]["attention"] = {"name": "sliding_window", "window": 3}
    assert not list(_validator(schema).iter_errors(bad))


def test_loggers_are_a_list_of_registered_loggers(schema):
    base = load_raw(SPECS / "tiny.toml")
    base["train"]["loggers"] = [{"name": "csv"}, {"name": "tensorboard", "dir": "tb"}]
    _validator(schema).validate(base)
    base["train"]["loggers"] = [{"name": "csv", "bogus": 1}]
    assert list(_validator(schema).iter_errors(base))
    base["train"]["loggers"] = [{"name": "nope"}]
    assert list(_validator(schema).iter_errors(base))


def test_a_table_without_name_is_the_default_component(schema):
    # The loader reads [optimizer] lr = 1e-3 as AdamW's table: so does the schema; a table
    # naming another component, or options the default does not have, still fail.
    v = _validator(schema)
    base = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 4}}
    v.validate({**base, "optimizer": {"lr": 1e-3, "betas": [0.9, 0.95]}})
    v.validate({**base, "model": {**base["model"], "ffn": {"multiplier": 2.0}}})
    assert not v.is_valid({**base, "optimizer": {"lr": 1e-3, "no_such_option": 1}})
    assert not v.is_valid({**base, "optimizer": {"name": "sgd", "betas": [0.9, 0.95]}})
