"""registry.toml and the code agree."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from pydantic import BaseModel

import llmkit
from llmkit.components.builtin import catalogue
from llmkit.contracts import PositionalScheme
from llmkit.registry import import_target
from tests.conftest import ROOT

ENTRIES = catalogue()["component"]


def test_root_catalogue_is_the_packaged_one():
    assert (ROOT / "registry.toml").read_text() == (
        Path(llmkit.__file__).with_name("registry.toml").read_text()
    )


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: f"{e['kind']}.{e['name']}")
def test_every_entry_imports_and_has_a_strict_options_model(entry):
    target = import_target(entry["target"])
    assert callable(target)
    opts = getattr(target, "Options", None) or importlib.import_module(target.__module__).Options
    assert issubclass(opts, BaseModel)
    assert opts.model_config.get("extra") == "forbid"
    opts()  # defaults are valid
    doc = target.__doc__ or importlib.import_module(target.__module__).__doc__
    assert doc and doc.strip(), f"{entry['target']} needs a docstring naming its source"
    if entry["kind"] == "position":
        assert issubclass(target, PositionalScheme)
        assert set(target.acts_on) == set(entry["capabilities"]["acts_on"])


def test_every_component_module_is_catalogued():
    listed = {e["target"].split(":")[0] for e in ENTRIES}
    base = Path(llmkit.__file__).parent / "components"
    for kind in catalogue()["kinds"]:
        sources = {p.stem: p.read_text() for p in (base / kind).glob("*.py")}
        for stem in sources:
            module = f"llmkit.components.{kind}.{stem}"
            # a helper module of a component (rope_scaling for rope) is imported by one
            helper = any(
                f"from {module} import" in text
                for other, text in sources.items()
                if f"llmkit.components.{kind}.{other}" in listed
            )
            if stem != "__init__" and not helper:
                assert module in listed, stem
