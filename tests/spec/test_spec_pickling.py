"""Specs and models holding them pickle (``torch.save`` of a whole model, multiprocessing),
although the spec's pydantic classes are built at run time from the registry's kinds."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from llmkit.errors import SpecError
from llmkit.model import build_model
from llmkit.spec import load_spec_dict, sections
from tests.helpers import tiny_spec


def _spec():
    override = {"layers": [0], "ffn": {"name": "swiglu"}}
    return load_spec_dict(tiny_spec(d_model=64, vocab_size=128, overrides=[override]))


def test_every_spec_table_round_trips_through_pickle():
    rs = _spec()
    for value in (rs.spec, rs.spec.model, rs.spec.train, rs.spec.model.overrides[0], rs):
        back = pickle.loads(pickle.dumps(value))
        assert type(back) is type(value)
        if value is not rs:
            assert back == value
    assert pickle.loads(pickle.dumps(rs)).spec == rs.spec


def test_a_saved_model_loads_in_a_fresh_process(tmp_path):
    torch.manual_seed(0)
    model = build_model(_spec()).eval()
    idx = torch.arange(8)[None]
    torch.save(model, tmp_path / "model.pt")
    torch.save(model(idx).logits, tmp_path / "logits.pt")
    code = (
        "import torch, sys; d = sys.argv[1]; "
        "m = torch.load(d + '/model.pt', weights_only=False).eval(); "
        "ok = torch.equal(m(torch.arange(8)[None]).logits, torch.load(d + '/logits.pt')); "
        "print(type(m.spec.spec).__name__, m.config.overrides[0].layers, ok)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["Spec", "[0]", "True"]


def test_a_spec_saved_with_other_kinds_names_the_cause():
    values = _spec().spec.model_dump(mode="python", round_trip=True)
    with pytest.raises(SpecError, match="other component kinds"):
        sections._rebuild_table((("no-such-kind", "", "model.nothing", None, False),), "", values)
