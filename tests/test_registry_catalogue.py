"""registry.toml and the code agree."""

from __future__ import annotations

import importlib
import subprocess
import sys
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
    # the catalogue names the very model the component uses (they cannot drift apart)
    assert import_target(entry["options"]) is opts, entry["options"]
    assert issubclass(opts, BaseModel)
    assert opts.model_config.get("extra") == "forbid"
    opts()  # defaults are valid
    doc = target.__doc__ or importlib.import_module(target.__module__).__doc__
    assert doc and doc.strip(), f"{entry['target']} needs a docstring naming its source"
    if entry["kind"] == "position":
        assert issubclass(target, PositionalScheme)
        assert set(target.acts_on) == set(entry["capabilities"]["acts_on"])


def test_the_catalogued_options_import_no_torch():
    """A spec is read, validated and given its schema from the catalogue's options models
    alone: their modules import neither torch nor the components' other heavy libraries."""
    code = (
        "import sys\nfrom llmkit.registry import import_target\n"
        f"for target in {sorted({e['options'] for e in ENTRIES})!r}:\n"
        "    import_target(target)\n"
        "heavy = [m for m in ('torch', 'triton', 'datasets') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_options_modules_hold_options_only_for_their_kind():
    """``llmkit.components.<kind>.options`` holds that kind's options (or the entry names
    :class:`llmkit.options.NoOptions`)."""
    for entry in ENTRIES:
        module = entry["options"].partition(":")[0]
        assert module in ("llmkit.options", f"llmkit.components.{entry['kind']}.options"), entry


def test_every_component_module_is_catalogued():
    listed = {e[key].split(":")[0] for e in ENTRIES for key in ("target", "options")}
    base = Path(llmkit.__file__).parent / "components"
    for kind in catalogue()["kinds"]:
        sources = {p.stem: p.read_text() for p in (base / kind).glob("*.py")}
        # a helper module of a component (rope_scaling for rope) or of the kind's options
        # (ffn's width) is imported by one of them, or by another helper
        used = {s for s in sources if f"llmkit.components.{kind}.{s}" in listed}
        grown = True
        while grown:
            helpers = {
                stem
                for stem in sources
                if any(f"from llmkit.components.{kind}.{stem} import" in sources[o] for o in used)
            }
            grown = not helpers <= used
            used |= helpers
        for stem in sources:
            if stem != "__init__":
                assert stem in used, f"llmkit.components.{kind}.{stem} is not catalogued"
