"""Adapters on linear layers: LoRA and DoRA start as the base, train alone, merge exactly."""

from __future__ import annotations

import math

import pytest
import torch

from llmkit.errors import LlmkitError
from llmkit.model import build_model
from llmkit.model.adapters import (
    attach_adapters,
    has_adapters,
    load_trainable_state,
    merge_adapters,
    trainable_state,
)
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec


def adapted(adapter: dict, **model):
    rs = load_spec_dict(tiny_spec(adapter=adapter, **model))
    torch.manual_seed(0)
    m = build_model(rs)
    base = {k: v.clone() for k, v in m.state_dict().items()}
    report = attach_adapters(m, rs.components["model.adapter"])
    return m, base, report


def perturb(model) -> None:
    """Make the adapters do something (B starts at zero)."""
    torch.manual_seed(3)
    with torch.no_grad():
        for _n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)


def logits(model, x):
    model.eval()
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("name", ["lora", "dora"])
def test_an_adapted_model_starts_as_its_base_and_merges_to_the_same_outputs(name):
    m, base, report = adapted({"name": name, "rank": 4, "targets": ["attn.qkv", "ffn.*"]})
    x = torch.randint(0, 64, (2, 12))
    plain = build_model(load_spec_dict(tiny_spec()))
    plain.load_state_dict(base)
    torch.testing.assert_close(logits(m, x), logits(plain, x), rtol=1e-5, atol=1e-5)
    assert len(report.layers) == 6  # 2 layers × (qkv, ffn in, ffn out)
    perturb(m)
    before = logits(m, x)
    assert not torch.allclose(before, logits(plain, x), atol=1e-3)
    assert merge_adapters(m) == 6 and not has_adapters(m)
    torch.testing.assert_close(logits(m, x), before, rtol=1e-5, atol=1e-5)
    assert set(m.state_dict()) == set(plain.state_dict())  # plain keys again


def test_only_adapters_and_also_train_are_trainable():
    m, _, report = adapted({"name": "lora", "rank": 2, "also_train": ["*norm_f*"]})
    names = {n for n, p in m.named_parameters() if p.requires_grad}
    assert names == {
        *(
            f"layers.{i}.attn.{p}.parametrizations.weight.0.{ab}"
            for i in (0, 1)
            for p in ("qkv", "out_proj")
            for ab in "AB"
        ),
        "norm_f.weight",
        "norm_f.bias",
    }
    assert report.trainable == sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert "of" in report.line() and "%" in report.line()


def test_gradients_reach_only_the_trainable_parameters():
    m, _, _ = adapted({"name": "lora", "rank": 2})
    m.train()
    x = torch.randint(0, 64, (2, 12))
    m(x, x).loss.backward()
    for n, p in m.named_parameters():
        assert (p.grad is not None) == p.requires_grad, n


def test_lora_update_and_scales():
    m, _, _ = adapted(
        {"name": "lora", "rank": 4, "alpha": 8.0, "targets": ["layers.0.attn.out_proj"]}
    )
    mod = m.layers[0].attn.out_proj
    lora = mod.parametrizations.weight[0]
    assert lora.scale == 2.0
    perturb(m)
    want = mod.parametrizations.weight.original + 2.0 * lora.B @ lora.A
    torch.testing.assert_close(mod.weight, want)
    rs, _, _ = adapted({"name": "lora", "rank": 4, "alpha": 8.0, "rank_stabilized": True})
    assert rs.layers[0].attn.qkv.parametrizations.weight[0].scale == pytest.approx(8 / math.sqrt(4))


def test_dora_keeps_a_magnitude_per_output_row():
    m, _, _ = adapted({"name": "dora", "rank": 2, "targets": ["layers.1.ffn.in_proj"]})
    mod = m.layers[1].ffn.in_proj
    dora = mod.parametrizations.weight[0]
    perturb(m)
    torch.testing.assert_close(mod.weight.norm(dim=1), dora.m.detach().abs(), rtol=1e-5, atol=1e-6)


def test_a_tied_head_is_not_adapted_and_a_pattern_matching_nothing_is_an_error():
    with pytest.raises(LlmkitError, match=r"'lm_head' matches no linear layer \(only tied"):
        adapted({"name": "lora", "targets": ["lm_head"]})
    _m, _, report = adapted({"name": "lora", "targets": ["lm_head"]}, tie_embeddings=False)
    assert report.layers == ["lm_head"]
    with pytest.raises(LlmkitError, match=r"'attn\.q_proj' matches no linear layer.*attn\.qkv"):
        adapted({"name": "lora", "targets": ["attn.q_proj"]})
    with pytest.raises(LlmkitError, match="also_train: 'nothing' matches no parameter"):
        adapted({"name": "lora", "also_train": ["nothing"]})


def test_trainable_state_round_trips_and_is_checked():
    m, _, _ = adapted({"name": "lora", "rank": 2})
    perturb(m)
    state = trainable_state(m)
    other, _, _ = adapted({"name": "lora", "rank": 2})
    load_trainable_state(other, state, "here")
    x = torch.randint(0, 64, (1, 8))
    torch.testing.assert_close(logits(other, x), logits(m, x))
    with pytest.raises(LlmkitError, match="do not fit"):
        load_trainable_state(other, dict(list(state.items())[1:]), "here")
    bigger, _, _ = adapted({"name": "lora", "rank": 3})
    with pytest.raises(LlmkitError, match=r"is \(2, 32\) in the file"):
        load_trainable_state(bigger, state, "here")


@pytest.mark.parametrize("bad", [{"rank": 0}, {"alpha": -1}, {"targets": []}, {"dropout": 0.1}])
def test_bad_options_are_spec_errors(bad):
    from llmkit.errors import SpecError

    with pytest.raises(SpecError):
        load_spec_dict(tiny_spec(adapter={"name": "lora", **bad}))


def test_also_trained_weights_may_be_adapted_layers_too():
    # A resized vocabulary trains the embedding and an untied head; with an adapter on the
    # head as well, its original weight is what trains (and is saved).
    from llmkit.runs import vocabulary_tensors

    rs = load_spec_dict(tiny_spec(adapter={"name": "lora", "rank": 2, "targets": ["lm_head"]},
                                  tie_embeddings=False))  # fmt: skip
    m = build_model(rs)
    attach_adapters(m, rs.components["model.adapter"], also=vocabulary_tensors(m))
    saved = set(trainable_state(m))
    assert {"tok_emb.weight", "lm_head.parametrizations.weight.original"} <= saved
    assert any("lora" in k or "parametrizations.weight.0" in k for k in saved)
