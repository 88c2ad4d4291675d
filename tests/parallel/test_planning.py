"""Planning a layout on paper (llmkit.parallel.planning): the arithmetic, by hand."""

from __future__ import annotations

import dataclasses

import pytest

from llmkit.errors import LlmkitError
from llmkit.parallel.layout import Layout, parse_layout
from llmkit.parallel.planning import (
    GPUS,
    ModelShape,
    gpu_spec,
    model_shape,
    plan_memory,
    stage_layers,
)

#: A toy model whose numbers are easy by hand: 8 layers of 1,000,000 split-able elements and
#: 1,000 of norms, an embedding of 64,000 × 64, a head of the same plus a 64-element norm.
LAYERS = 8
SHAPE = ModelShape(
    n_layers=LAYERS,
    d_model=64,
    n_heads=8,
    kv_heads=4,
    head_dim=8,
    vocab_size=64_000,
    layer_params=(1_001_000,) * LAYERS,
    layer_replicated=(1_000,) * LAYERS,
    embedding_params=64_000 * 64,
    head_params=64_000 * 64 + 64,
    head_replicated=64,
    train_flops_per_token=6e6,
)
PARAMS = SHAPE.params


def plan(layout: str | Layout, shape: ModelShape = SHAPE, **kw):
    kw = {"batch_size": 8, "seq_len": 256} | kw
    lay = parse_layout(layout) if isinstance(layout, str) else layout
    return plan_memory(shape, lay, **kw)


def test_one_gpu_holds_everything_in_fp32_master_grads_and_two_adam_states():
    p = plan("dp=1")
    assert (p.param_bytes, p.grad_bytes, p.optimizer_bytes) == (
        4 * PARAMS,
        4 * PARAMS,
        8 * PARAMS,
    )
    assert p.unsharded_bytes == 2 * PARAMS  # autocast's bf16 copies
    assert plan("dp=1", precision="fp32").unsharded_bytes == 0
    assert p.comm_total == 0 and set(p.comm.values()) == {0}


def test_dp_shard_divides_params_grads_and_optimizer_and_dp_replicate_does_not():
    one, shard, rep = plan("dp=1"), plan("dp=8"), plan("ddp=8")
    for field in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert getattr(shard, field) * 8 == getattr(one, field)
        assert getattr(rep, field) == getattr(one, field)
    # the activations of a data-parallel rank's batch do not depend on the data parallelism
    assert one.activation_bytes == shard.activation_bytes == rep.activation_bytes


def test_fsdp_volume_by_hand():
    """ZeRO-3 over n = 4: bf16 all-gather in the forward and again in the backward, fp32
    reduce-scatter, each sending (n − 1)/n of the whole."""
    p = plan("dp=4")
    assert p.comm["fsdp"] == round(3 / 4 * PARAMS * (2 + 2 + 4))
    assert p.comm["ddp"] == p.comm["tp"] == p.comm["cp"] == p.comm["pp"] == 0
    # fp32: 4-byte all-gathers
    assert plan("dp=4", precision="fp32").comm["fsdp"] == round(3 / 4 * PARAMS * 12)
    # cp joins the FSDP group: dp_shard × cp = 4 shards as well
    assert plan("dp=2,cp=2").comm["fsdp"] == p.comm["fsdp"]
    assert plan("dp=2,cp=2").param_bytes == p.param_bytes


def test_ddp_and_hsdp_all_reduce_by_hand():
    assert plan("ddp=4").comm["ddp"] == round(2 * 3 / 4 * PARAMS * 4)
    hsdp = plan("ddp=2,dp=4")
    shard = -(-PARAMS // 4)
    assert hsdp.comm["ddp"] == round(2 * 1 / 2 * shard * 4)  # the shard, across replicas
    assert hsdp.comm["fsdp"] == plan("dp=4").comm["fsdp"]


def test_doubling_tp_halves_the_split_parameters_and_not_the_norms():
    def split_params(p) -> int:
        replicated = LAYERS * 1_000 + 64
        return p.memory_rank.params - replicated

    one, two, four = plan("tp=1"), plan("tp=2"), plan("tp=4")
    assert split_params(two) * 2 == split_params(one)
    assert split_params(four) * 2 == split_params(two)
    assert two.memory_rank.params == (PARAMS - LAYERS * 1_000 - 64) // 2 + LAYERS * 1_000 + 64
    # and the activations (sequence parallelism splits all of them)
    assert two.activation_bytes * 2 == one.activation_bytes


def test_tp_volume_by_hand():
    """8 collectives per layer (4 forward, 4 backward) + 3 at the embedding + 2 at the head,
    each sending (tp − 1)/tp of b·s·h bf16 values; activation checkpointing adds 4 per layer."""
    b, s, h = 8, 256, 64
    p = plan("tp=2")
    assert p.comm["tp"] == round((8 * LAYERS + 5) * 1 / 2 * b * s * h * 2)
    ac = plan("tp=2", activation_checkpointing=True)
    assert ac.comm["tp"] == round((12 * LAYERS + 5) * 1 / 2 * b * s * h * 2)


def test_pp_splits_layers_by_stage_and_puts_embedding_first_and_head_last():
    assert stage_layers(10, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    p = plan(parse_layout("pp=4"))
    first, mid, _, last = p.ranks
    assert first.params == 2 * 1_001_000 + 64_000 * 64
    assert mid.params == 2 * 1_001_000
    assert last.params == 2 * 1_001_000 + 64_000 * 64 + 64
    # ~ a quarter of the layers' parameters
    assert mid.param_bytes * 4 == plan("pp=1").param_bytes - 4 * (2 * 64_000 * 64 + 64)


def test_tied_head_is_counted_on_the_last_stage_only_under_pp():
    tied = dataclasses.replace(SHAPE, tied=True, head_params=64, head_replicated=64)
    assert plan("pp=1", tied).memory_rank.params == tied.params
    last = plan("pp=2", tied).ranks[-1]
    assert last.params == 4 * 1_001_000 + 64 + 64_000 * 64


def test_cp_halves_activations():
    one, two = plan("dp=1"), plan("cp=2")
    assert two.activation_bytes * 2 == one.activation_bytes


def test_activation_formula_by_hand():
    """Korthikanti et al.: s·b·h·34 bytes per layer at 16 bits, plus fp32 logits and grad."""
    b, s, h = 8, 256, 64
    layers = LAYERS * s * b * h * 34
    logits = b * s * 64_000 * 8
    assert plan("dp=1").activation_bytes == layers + logits
    scores = dataclasses.replace(SHAPE, scores=(True,) * LAYERS)
    per = 34 + 5 * 8 * s / h
    assert plan("dp=1", scores).activation_bytes == round(LAYERS * s * b * h * per) + logits
    ac = plan("dp=1", activation_checkpointing=True)
    assert ac.activation_bytes == LAYERS * 2 * s * b * h + s * b * h * 34 + logits


def test_1f1b_holds_pp_microbatches_and_gpipe_all_of_them():
    kw = {"batch_size": 16}
    f1b = plan(Layout(pp=4, microbatches=16), **kw)
    gpipe = plan(Layout(pp=4, microbatches=16, schedule="gpipe"), **kw)
    assert [r.inflight for r in f1b.ranks] == [4, 3, 2, 1]
    assert [r.inflight for r in gpipe.ranks] == [16] * 4
    per_micro = f1b.ranks[1].activation_bytes / 3
    assert gpipe.ranks[1].activation_bytes == pytest.approx(16 * per_micro)
    # with as many micro-batches as stages the two hold the same on the first rank
    assert plan(Layout(pp=4, microbatches=4), **kw).ranks[0].inflight == 4
    # interleaved (v = 2): rank 0 holds 1 + (pp − 1)/(pp·v) of its layers' pp micro-batches
    inter = plan(Layout(pp=4, microbatches=8, stages_per_rank=2, schedule="interleaved_1f1b"), **kw)
    assert inter.ranks[0].inflight == pytest.approx(4 * (1 + 3 / 8))


def test_pp_and_cp_volumes_by_hand():
    b, s, h = 8, 256, 64
    p = plan(Layout(pp=4, microbatches=4))
    micro = b // 4
    act = micro * s * h * 2
    sent = [r.comm["pp"] for r in p.ranks]
    assert sent == [4 * act, 4 * 2 * act, 4 * 2 * act, 4 * act]
    # under pp the parameters are gathered once, not re-gathered in the backward
    fsdp = plan(Layout(dp_shard=2, pp=4, microbatches=4))
    r0 = fsdp.ranks[0]
    assert r0.comm["fsdp"] == round(1 / 2 * r0.params * (2 + 4))
    c = plan("cp=2")
    kv = 2 * b * (s // 2) * 4 * 8  # K and V of the rank's tokens, 4 kv heads of 8
    assert c.comm["cp"] == LAYERS * (2 * 1 * kv * 2 + 2 * kv * 4)


def test_comm_is_zero_for_dimensions_of_degree_one():
    p = plan("dp=4,tp=2")
    assert p.comm["ddp"] == p.comm["cp"] == p.comm["pp"] == 0
    assert p.comm["fsdp"] > 0 and p.comm["tp"] > 0
    assert p.comm_total == p.comm["fsdp"] + p.comm["tp"]


def test_gpu_table_fits_and_step_time():
    assert gpu_spec("h100") is gpu_spec("H100") is GPUS["H100"]
    assert GPUS["H200"].memory_bytes == 141 * 10**9 and GPUS["A100"].peak_flops == 312e12
    with pytest.raises(LlmkitError, match="unknown GPU 'B300'"):
        gpu_spec("B300")
    p = plan("dp=4", gpu="h100")
    assert p.fits is True
    tokens = 4 * 8 * 256
    assert p.step_time == pytest.approx(6e6 * tokens / (4 * 989e12 * 0.4))
    assert plan("dp=4").fits is None and plan("dp=4").step_time is None
    huge = dataclasses.replace(SHAPE, layer_params=(10**10,) * LAYERS)
    assert plan("dp=1", huge, gpu="A100").fits is False


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("tp=3", "tp = 3 does not divide n_heads = 8"),
        ("pp=16", "16 pipeline stages but 8 layers"),
        ("cp=3", "multiple of 2·cp = 6"),
    ],
)
def test_layouts_the_arithmetic_cannot_split_are_one_line(layout, message):
    with pytest.raises(LlmkitError, match=message):
        plan(layout)
    with pytest.raises(LlmkitError, match="do not divide the batch of 8"):
        plan(Layout(pp=2, microbatches=3))


def test_model_shape_of_a_built_model_on_meta():
    from llmkit.model import build_on_meta
    from llmkit.spec import load_spec
    from tests.conftest import SPECS

    model = build_on_meta(load_spec(str(SPECS / "tiny.toml"), []))
    shape = model_shape(model, 256)
    assert shape.params == model.num_params()
    assert shape.tied and shape.head_params == shape.head_replicated  # the final norm only
    assert shape.train_flops_per_token == model.flops_per_token(256)["train"]
    p = plan_memory(model, parse_layout("dp=2,tp=2"), batch_size=2, seq_len=256)
    assert p.memory_rank.params < model.num_params() // 2 + 10_000
