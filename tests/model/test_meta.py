"""Models on the meta device: the same shapes as a real build, no values, no dynamo import."""

from __future__ import annotations

import subprocess
import sys

from llmkit.model import build_model, build_on_meta
from llmkit.spec import load_spec_dict
from tests.conftest import ROOT
from tests.helpers import tiny_spec


def test_meta_build_has_the_real_build_shapes():
    rs = load_spec_dict(tiny_spec(position={"name": "rope"}, norm={"name": "rmsnorm"}))
    meta, real = build_on_meta(rs), build_model(rs)
    shapes = {n: (p.shape, p.dtype) for n, p in real.state_dict().items()}
    assert {n: (p.shape, p.dtype) for n, p in meta.state_dict().items()} == shapes
    assert all(p.is_meta for p in meta.parameters())
    assert meta.num_params() == real.num_params()


_WITHOUT_DYNAMO = """
import sys, torch
import llmkit.model.transformer as transformer
from llmkit.model import build_on_meta
from llmkit.model.meta import CACHE_ATTR, meta_device
from llmkit.spec import load_spec, load_spec_dict
from tests.helpers import tiny_spec

def loaded():
    return "torch._dynamo" in sys.modules

# RoPE's float64 arange and the init's normal_ run decompositions on the meta device.
rope = load_spec_dict(tiny_spec(position={"name": "rope"}))
mistral = load_spec("specs/mistral-style.toml", [])
print(build_on_meta(rope).num_params(), build_on_meta(mistral).num_params())
print(loaded())
with meta_device() as stand_in:
    torch.nn.init.normal_(torch.empty(3))
print(len(stand_in.given) > 0, any(hasattr(f, CACHE_ATTR) for f in stand_in.given), loaded())

# A build that asks dynamo for more than disable(): built again with the real one.
real_build = transformer.build_model
def asking(rs):
    torch._dynamo.config  # absent from the stand-in
    return real_build(rs)
transformer.build_model = asking
print(build_on_meta(rope).num_params(), loaded())
# The wrappers the stand-in served now wrap with the real dynamo.
with meta_device() as none:
    torch.nn.init.normal_(torch.empty(3))
print(none, all(getattr(f, CACHE_ATTR) is not f for f in stand_in.given))
"""


def test_a_meta_build_does_not_import_dynamo():
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_DYNAMO],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rope = build_on_meta(load_spec_dict(tiny_spec(position={"name": "rope"}))).num_params()
    assert out.stdout.split("\n")[:5] == [
        f"{rope} 7241732096",
        "False",
        "True False False",
        f"{rope} True",
        "None True",
    ]
