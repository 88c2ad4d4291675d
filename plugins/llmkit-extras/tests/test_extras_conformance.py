"""llmkit's conformance suite over every component this plugin registers, loaded the way
users get them: through the installed ``extras`` entry point."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmkit import Registry, load_spec
from llmkit.testing import check_component, check_model_combination, conformance_params

PROVIDER = "llmkit-extras"
SPECS = Path(__file__).resolve().parent.parent / "specs"


def extras_registry() -> Registry:
    reg = Registry()
    reg.load_entry_points(["extras"])  # llmkit's built-in plugin and this one
    info = reg.plugins.get("extras")
    assert info is not None, "llmkit-extras is not installed: pip install -e plugins/llmkit-extras"
    assert info.error is None, info.error
    return reg


REGISTRY = extras_registry()
PARAMS = [p for p in conformance_params(registry=REGISTRY) if p.values[0].provider == PROVIDER]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster and steadier
    yield
    torch.set_num_threads(threads)


def test_the_plugin_registers_what_it_documents():
    assert sorted(p.id for p in PARAMS) == [
        "norm.dyt",
        "norm.scalenorm",
        "optimizer.ademamix",
        "qk_transform.qk_norm",
        "schedule.rex",
    ]
    for param in PARAMS:
        record = param.values[0]
        assert isinstance(record.target, str), "targets stay lazy until used"
        assert record.summary and record.version == "0.1.0"


@pytest.mark.parametrize("record", PARAMS)
def test_component_conforms(record):
    check_component(record)


VARIANTS = [
    ("qk_transform", "qk_norm", {"gain": "scalar"}),
    ("qk_transform", "qk_norm", {"gain": "none"}),
    ("qk_transform", "qk_norm", {"shared": True}),
    ("norm", "dyt", {"alpha_init": 2.0, "bias": False}),
    ("norm", "dyt", {"bias": True}),
    ("norm", "scalenorm", {"scale_init": 1.0}),
    ("optimizer", "ademamix", {"alpha_beta3_warmup": 20, "weight_decay": 0.1}),
    ("optimizer", "ademamix", {"alpha": 0.0, "betas": [0.0, 0.99, 0.999]}),
    ("schedule", "rex", {"min_lr_ratio": 0.1}),
]


@pytest.mark.parametrize(
    ("kind", "name", "options"),
    VARIANTS,
    ids=[f"{k}.{n}-{'-'.join(f'{a}={b}' for a, b in o.items())}" for k, n, o in VARIANTS],
)
def test_variant_conforms(kind, name, options):
    check_component(REGISTRY.get(kind, name), options)


QK_NORM = {"qk_transform": {"name": "qk_norm"}}


@pytest.mark.parametrize(
    ("attention", "position", "ffn", "norm", "model"),
    [
        ("sdpa", "rope", "swiglu", "dyt", QK_NORM),
        ("flash", "alibi", "mlp", "scalenorm", QK_NORM),
        ({"name": "sliding_window", "window": 4}, "rope", "mlp", "dyt", QK_NORM),
        ("sdpa", "learned", "mlp", "dyt", {}),
    ],
    ids=["sdpa-rope", "flash-alibi", "sliding_window-rope", "sdpa-learned"],
)
def test_parts_build_a_model_that_trains_and_decodes(attention, position, ffn, norm, model):
    check_model_combination(attention, position, ffn, norm, model=model, registry=REGISTRY)


def test_example_spec_validates():
    rs = load_spec(SPECS / "tiny-extras.toml", registry=REGISTRY)
    assert rs.layers[0].get("qk_transform").name == "qk_norm" and rs.norm.name == "dyt"
    assert rs.optimizer.name == "ademamix" and rs.schedule.name == "rex"
