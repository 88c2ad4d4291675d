"""The ``block`` kind: each block's formula against a hand-written reference, pre/post-norm
models unchanged by the redesign (weights, checkpoint keys, logits), per-layer block
overrides, the ``model.norm_placement`` mapping, and the conformance check catching broken
blocks."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from llmkit import hookimpl
from llmkit.contracts import AttentionInputs, Block, NoOptions
from llmkit.errors import LlmkitError, SpecError
from llmkit.model import build_model
from llmkit.registry import get_registry
from llmkit.spec import load_spec, load_spec_dict
from llmkit.testing import check_component, check_model_combination
from llmkit.testing.block import check_block
from tests.conftest import SPECS
from tests.helpers import registry_with, tiny_spec

BLOCKS = ["pre_norm", "post_norm", "parallel", "sandwich"]


def _model(block=None, seed=0, **model):
    spec = tiny_spec(position={"name": "rope"}, norm={"name": "rmsnorm"}, **model)
    if block is not None:
        spec["model"]["block"] = block
    torch.manual_seed(seed)
    return build_model(load_spec_dict(spec)).eval()


def _inputs(model, t: int) -> AttentionInputs:
    return AttentionInputs(model.layer_position(0), torch.arange(t))


def test_the_catalogue_registers_the_four_blocks_and_the_kind():
    reg = get_registry()
    assert [c.name for c in reg.list("block")] == sorted(BLOCKS)
    kind = reg.kinds["block"]
    assert (kind.section, kind.default, kind.per_layer) == ("model.block", "pre_norm", True)


# -- formulas -----------------------------------------------------------------------------------


def _reference(name: str, b, x: Tensor, inputs: AttentionInputs) -> Tensor:
    """Each block written out by hand from its own submodules."""
    attn = lambda h: b.attn(h, inputs)  # noqa: E731
    if name == "pre_norm":
        h = x + attn(b.norm1(x))
        return h + b.ffn(b.norm2(h))
    if name == "post_norm":
        h = b.norm1(x + attn(x))
        return b.norm2(h + b.ffn(h))
    if name == "parallel":
        n2 = b.norm1 if b.norm2 is None else b.norm2
        return x + attn(b.norm1(x)) + b.ffn(n2(x))
    assert name == "sandwich"
    h = x + b.attn_post_norm(attn(b.norm1(x)))
    return h + b.ffn_post_norm(b.ffn(b.norm2(h)))


@pytest.mark.parametrize(
    ("name", "options"),
    [(n, {}) for n in BLOCKS] + [("parallel", {"shared_norm": False})],
    ids=[*BLOCKS, "parallel-two-norms"],
)
def test_each_block_computes_its_formula(name, options):
    model = _model({"name": name, **options})
    block = model.layers[0]
    assert type(block).__name__.lower().startswith(name.replace("_", ""))
    with torch.no_grad():  # non-trivial norm gains, so every norm's place shows
        for n, p in block.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            block(x, _inputs(model, 9)), _reference(name, block, x, _inputs(model, 9))
        )


def test_parallel_block_shares_one_norm_unless_asked_for_two():
    shared = _model({"name": "parallel"}).layers[0]
    two = _model({"name": "parallel", "shared_norm": False}).layers[0]
    assert shared.norm2 is None and two.norm2 is not None
    names = {k.split(".")[0] for k in shared.state_dict()}
    assert names == {"norm1", "attn", "ffn"}
    assert {k.split(".")[0] for k in two.state_dict()} == {"norm1", "norm2", "attn", "ffn"}


def test_sandwich_block_keys():
    keys = {k.split(".")[0] for k in _model({"name": "sandwich"}).layers[0].state_dict()}
    assert keys == {"norm1", "attn", "attn_post_norm", "norm2", "ffn", "ffn_post_norm"}


# -- pre/post norm unchanged ------------------------------------------------------------------

#: ``logits[0, :, 0]`` and ``logits.sum()`` of the models below, computed by llmkit before the
#: block became a kind (torch.manual_seed(0), tiny_spec with rope and rmsnorm).
BEFORE = {
    "pre": (
        [-0.027465, 0.16977, 0.006542, 0.107672, -0.022333, 0.047702, 0.592329],
        12.669980722494074,
    ),
    "post": (
        [-0.03101, 0.208354, 0.028199, 0.038982, -0.064197, 0.022132, 0.643289],
        11.440820327203255,
    ),
}
LAYER_KEYS = [
    "norm1.weight",
    "attn.qkv.weight",
    "attn.qkv.bias",
    "attn.out_proj.weight",
    "attn.out_proj.bias",
    "norm2.weight",
    "ffn.in_proj.weight",
    "ffn.in_proj.bias",
    "ffn.out_proj.weight",
    "ffn.out_proj.bias",
]


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_pre_and_post_norm_models_are_unchanged(placement):
    model = _model(norm_placement=placement)
    expected = ["tok_emb.weight"]
    expected += [f"layers.{j}.{k}" for j in range(2) for k in LAYER_KEYS]
    expected += ["norm_f.weight", "lm_head.weight"]
    assert list(model.state_dict()) == expected  # checkpoints of earlier runs still load
    idx = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(idx).logits
    first, total = BEFORE[placement]
    torch.testing.assert_close(logits[0, :, 0], torch.tensor(first), atol=1e-5, rtol=0)
    assert abs(logits.double().sum().item() - total) < 1e-3


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_writing_the_block_or_the_placement_builds_the_same_model(placement):
    block = f"model.block.name={placement}_norm"
    models = []
    for sets in ([f"model.norm_placement={placement}"], [block]):
        torch.manual_seed(0)
        models.append(build_model(load_spec(SPECS / "tiny.toml", sets)))
    a, b = models
    assert list(a.state_dict()) == list(b.state_dict())
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    assert type(a.layers[0]) is type(b.layers[0])
    assert a.layers[0].pre_norm is (placement == "pre")


# -- norm_placement mapping -------------------------------------------------------------------


def _resolve(**model):
    return load_spec_dict(tiny_spec(**model))


def test_norm_placement_selects_the_block():
    assert _resolve().model_slots["block"].name == "pre_norm"
    rs = _resolve(norm_placement="post")
    assert rs.model_slots["block"].name == "post_norm"
    assert {plan.block.name for plan in rs.layers} == {"post_norm"}


def test_the_block_sets_norm_placement_and_the_resolved_spec_round_trips():
    for block, placement in [("post_norm", "post"), ("parallel", "pre"), ("sandwich", "pre")]:
        rs = _resolve(block={"name": block})
        assert rs.model.norm_placement == placement
        assert rs.raw["model"]["block"]["name"] == block
        assert rs.raw["model"]["norm_placement"] == placement
        assert load_spec_dict(rs.raw).to_dict() == rs.to_dict()  # a run's spec.yaml reloads


@pytest.mark.parametrize(
    ("placement", "block"), [("post", "parallel"), ("post", "pre_norm"), ("pre", "post_norm")]
)
def test_a_contradiction_names_both_paths(placement, block):
    with pytest.raises(SpecError) as exc:
        _resolve(norm_placement=placement, block={"name": block})
    message = str(exc.value)
    assert "model.block" in message and "model.norm_placement" in message
    assert repr(block) in message


def test_agreeing_placement_and_block_are_accepted():
    assert (
        _resolve(norm_placement="post", block={"name": "post_norm"}).model_slots["block"].name
        == "post_norm"
    )
    assert (
        _resolve(norm_placement="pre", block={"name": "sandwich"}).model_slots["block"].name
        == "sandwich"
    )


def test_block_options_are_strict():
    with pytest.raises(SpecError, match=r"model\.block\.shared"):
        _resolve(block={"name": "parallel", "shared": False})
    with pytest.raises(SpecError, match=r"model\.block\.shared_norm"):
        _resolve(block={"name": "pre_norm", "shared_norm": False})


# -- per-layer overrides ------------------------------------------------------------------------


def test_per_layer_overrides_select_blocks():
    spec = tiny_spec(n_layers=4, position={"name": "rope"})
    spec["model"]["overrides"] = [
        {"layers": "::2", "block": {"name": "parallel"}},
        {"layers": [-1], "block": {"name": "sandwich"}},
    ]
    rs = load_spec_dict(spec)
    assert [plan.block.name for plan in rs.layers] == [
        "parallel",
        "pre_norm",
        "parallel",
        "sandwich",
    ]
    assert [layer["block"]["name"] for layer in rs.to_dict()["model"]["layers"]] == [
        "parallel",
        "pre_norm",
        "parallel",
        "sandwich",
    ]
    model = build_model(rs)
    kinds = [type(b).__name__ for b in model.layers]
    assert kinds == ["ParallelBlock", "PreNormBlock", "ParallelBlock", "SandwichBlock"]


def test_a_model_mixing_blocks_trains_and_decodes_through_the_cache():
    check_model_combination(
        "sdpa",
        "rope",
        "swiglu",
        "rmsnorm",
        model={
            "n_layers": 3,
            "block": {"name": "sandwich"},
            "overrides": [
                {"layers": [0], "block": {"name": "parallel", "shared_norm": False}},
                {"layers": [1], "block": {"name": "post_norm"}},
            ],
        },
    )


# -- third-party blocks and the conformance check ------------------------------------------------


class ScaledBlock(Block):
    """A plugin's block: pre-norm with a learned residual scale (LayerScale-like)."""

    Options = NoOptions

    def __init__(self, options, ctx, parts):
        super().__init__(options, ctx, parts)
        self.norm1, self.attn, self.norm2, self.ffn = (
            parts.norm(),
            parts.attention,
            parts.norm(),
            parts.ffn,
        )
        self.scale = torch.nn.Parameter(torch.full((ctx.d_model,), 0.5))

    def forward(self, x, inputs):
        x = x + self.scale * self.attn(self.norm1(x), inputs)
        return x + self.scale * self.ffn(self.norm2(x))


class NoResidualBlock(ScaledBlock):
    """Broken: the first sublayer's residual is dropped."""

    def forward(self, x, inputs):
        h = self.scale * self.attn(self.norm1(x), inputs)
        return h + self.scale * self.ffn(self.norm2(h))


class LeakyBlock(ScaledBlock):
    """Broken: mixes in the mean over all positions (sees the future)."""

    def forward(self, x, inputs):
        return super().forward(x, inputs) + x.mean(1, keepdim=True)


class ForgetfulBlock(Block):
    """Broken: builds its own ffn and never keeps the one it is given."""

    Options = NoOptions

    def __init__(self, options, ctx, parts):
        super().__init__(options, ctx, parts)
        self.norm1, self.attn = parts.norm(), parts.attention
        self.ffn = torch.nn.Linear(ctx.d_model, ctx.d_model)

    def forward(self, x, inputs):
        x = x + self.attn(self.norm1(x), inputs)
        return x + self.ffn(x)


class BlockPlugin:
    distribution = "llmkit-blocks"
    name = "blocks"

    @hookimpl
    def register_components(self, register):
        for name, cls in [
            ("scaled", ScaledBlock),
            ("no_residual", NoResidualBlock),
            ("leaky", LeakyBlock),
            ("forgetful", ForgetfulBlock),
        ]:
            register("block", name, cls, summary=cls.__doc__)


def test_a_plugin_block_builds_and_conforms():
    reg = registry_with(BlockPlugin())
    model = build_model(load_spec_dict(tiny_spec(block={"name": "scaled"}), registry=reg))
    assert "layers.1.scale" in model.state_dict()
    check_component(reg.get("block", "scaled"), registry=reg)


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("no_residual", "residual path is missing"),
        ("leaky", "not causal"),
        ("forgetful", "does not keep parts.ffn"),
    ],
)
def test_the_conformance_check_catches_broken_blocks(name, error):
    reg = registry_with(BlockPlugin())
    with pytest.raises(AssertionError, match=error):
        check_block(reg.get("block", name))


def test_the_model_refuses_a_block_that_drops_its_parts():
    reg = registry_with(BlockPlugin())
    with pytest.raises(LlmkitError, match="does not keep the ffn"):
        build_model(load_spec_dict(tiny_spec(block={"name": "forgetful"}), registry=reg))


def test_parallel_with_two_norms_conforms():
    check_component(get_registry().get("block", "parallel"), {"shared_norm": False})
