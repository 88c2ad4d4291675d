"""The mesh layout of ``train.parallel``: shorthands, filling, and what a spec cannot train on."""

from __future__ import annotations

import pytest

from llmkit.errors import LlmkitError
from llmkit.parallel.layout import Layout, layout_problems, parse_layout, resolve_layout
from llmkit.spec import load_spec_dict
from llmkit.spec.models import ParallelSpec
from tests.helpers import tiny_spec


def test_shorthands_keep_their_meaning():
    assert resolve_layout("ddp", 4) == Layout(dp_replicate=4, form="ddp")
    assert resolve_layout("auto", 4).mode == "ddp"
    assert resolve_layout("fsdp", 4).mode == "fsdp"
    assert resolve_layout("fsdp", 1).mode == "single"
    with pytest.raises(LlmkitError, match="'none' but the job was launched on 2"):
        resolve_layout("none", 2)


def test_a_table_fills_dp_shard_and_must_make_the_world_size():
    layout = resolve_layout(ParallelSpec(tp=2), 8)
    assert (layout.dp_shard, layout.tp, layout.dp, layout.mode) == (4, 2, 4, "mesh")
    assert resolve_layout(ParallelSpec(tp=2, dp_shard=1, dp_replicate=-1), 8).dp_replicate == 4
    with pytest.raises(LlmkitError, match="not a multiple of the other degrees' product 3"):
        resolve_layout(ParallelSpec(tp=3), 8)
    with pytest.raises(LlmkitError, match="is 4 processes, but the job was launched on 2"):
        resolve_layout(ParallelSpec(tp=2, dp_shard=2), 2)
    with pytest.raises(ValueError, match="only one of dp_replicate and dp_shard"):
        ParallelSpec(dp_replicate=-1, dp_shard=-1)
    interleaved = resolve_layout(ParallelSpec(pp=2, dp_shard=1, schedule="interleaved_1f1b"), 2)
    assert (interleaved.stages, interleaved.microbatches) == (4, 4)


def test_parse_layout_reads_the_command_line_form():
    layout = parse_layout("dp=32,tp=8,pp=4")
    assert (layout.dp_shard, layout.tp, layout.pp, layout.world_size) == (32, 8, 4, 1024)
    with pytest.raises(LlmkitError, match="is not NAME=N"):
        parse_layout("xp=2")
    with pytest.raises(LlmkitError, match="is not an integer"):
        parse_layout("tp=two")


def _spec(**model):
    return load_spec_dict(tiny_spec(**model)).spec


def test_layout_problems_name_what_does_not_divide():
    spec = _spec(n_heads=4, n_kv_heads=2, n_layers=2)
    assert layout_problems(spec, Layout(tp=2)) == []
    assert "does not divide model.n_heads = 4" in layout_problems(spec, Layout(tp=3))[0]
    assert layout_problems(spec, Layout(tp=4)) == []  # kv heads copied: 2 ranks share one
    odd = layout_problems(_spec(n_heads=12, n_kv_heads=4, d_model=48), Layout(tp=3))
    assert "neither divides nor is a multiple of model.n_kv_heads = 4" in odd[0]
    assert (
        "n_kv_heads = 3"
        in layout_problems(_spec(n_heads=6, n_kv_heads=3, d_model=48), Layout(tp=2))[0]
    )
    deep = layout_problems(spec, Layout(pp=4, microbatches=4))
    assert "4 pipeline stages" in deep[0] and "model.n_layers = 2" in deep[0]
    assert (
        "does not divide train.batch_size" in layout_problems(spec, Layout(pp=2, microbatches=3))[0]
    )
    assert "multiple of 2·cp" in layout_problems(_spec(max_seq_len=30), Layout(cp=2))[0]


def test_pipeline_refuses_what_its_stages_do_not_train():
    untied = _spec(n_layers=2, tie_embeddings=False)
    assert layout_problems(untied, Layout(pp=2, microbatches=2)) == []
    tied = layout_problems(_spec(n_layers=2, tie_embeddings=True), Layout(pp=2, microbatches=2))
    assert tied == [
        "train.parallel.pp = 2 cannot be combined with model.tie_embeddings (the embedding "
        "and the head sit on the first and the last stage; set it to false)"
    ]
    assert layout_problems(untied, Layout(pp=2, tp=2, cp=2, microbatches=2)) == []


def test_context_parallelism_refuses_score_biases_and_unsupported_kernels():
    rs = load_spec_dict(tiny_spec(position={"name": "alibi"}))
    kernels = [plan.attention for plan in rs.layers]
    positions = [plan.position for plan in rs.layers]
    found = layout_problems(rs.spec, Layout(cp=2), kernels, positions)
    assert any("position 'alibi' (layer 0) biases the attention scores" in p for p in found)
    dense = load_spec_dict(tiny_spec(attention={"name": "dense"}))
    found = layout_problems(dense.spec, Layout(cp=2), [p.attention for p in dense.layers])
    assert "does not declare the context_parallel capability" in found[0]
