"""Parity with transformers for Gemma and Gemma 2 (random small configs, fp32, see
hf_parity): √d embedding scale, (1 + w) RMSNorm, tanh-GELU GeGLU, MQA; Gemma 2's sandwich
norms, soft-capping, query_pre_attn_scalar and alternating sliding windows."""

from __future__ import annotations

import pytest

from llmkit.errors import LlmkitError
from llmkit.interop.convert import hf_to_llmkit
from tests.interop.hf_parity import check_family, make_hf

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=32, vocab_size=97,
             max_position_embeddings=128)  # fmt: skip


@pytest.mark.parametrize("attention", ["sdpa", "flash", "dense"])
def test_gemma_mqa(tmp_path, attention):
    check_family(tmp_path, "GemmaConfig", "GemmaForCausalLM", attention=attention, **SMALL)


def test_gemma2_softcaps_scale_and_alternating_windows(tmp_path):
    cfg = SMALL | dict(num_hidden_layers=3, num_key_value_heads=2, sliding_window=6,
                       query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                       final_logit_softcapping=3.0)  # fmt: skip
    check_family(tmp_path, "Gemma2Config", "Gemma2ForCausalLM", **cfg)


@pytest.mark.parametrize("attention", ["sdpa", "flash"])
def test_gemma2_without_attention_softcap_uses_any_kernel(tmp_path, attention):
    cfg = SMALL | dict(sliding_window=6, attn_logit_softcapping=None)
    check_family(tmp_path, "Gemma2Config", "Gemma2ForCausalLM", attention=attention, **cfg)


def test_bidirectional_gemma_is_refused(tmp_path):
    make_hf("GemmaConfig", "GemmaForCausalLM", tmp_path, use_bidirectional_attention=True,
            **SMALL)  # fmt: skip
    with pytest.raises(LlmkitError, match="bidirectional"):
        hf_to_llmkit(tmp_path)


@pytest.mark.parametrize("attention", ["sdpa", "flash"])
def test_gemma3_qk_norm_two_ropes_and_global_layers(tmp_path, attention):
    # layers 0, 1 slide (window 6, local θ 1e4); layer 2 is global (θ 1e6, linear scaling)
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    cfg = SMALL | dict(num_hidden_layers=3, num_key_value_heads=2, sliding_window=6,
                       layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                       query_pre_attn_scalar=24, rope_parameters=rope)  # fmt: skip
    check_family(tmp_path, "Gemma3TextConfig", "Gemma3ForCausalLM", attention=attention, **cfg)


@pytest.mark.parametrize("types", [["sliding_attention"] * 2, None])
def test_gemma3_whose_layers_all_slide_uses_the_local_rope(tmp_path, types):
    # All layers slide (said, or fewer layers than sliding_window_pattern): one model-wide
    # window, and every layer must rotate with the local θ, not the global one.
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    cfg = SMALL | dict(num_key_value_heads=2, sliding_window=6, rope_parameters=rope)
    if types is not None:
        cfg["layer_types"] = types
    check_family(tmp_path, "Gemma3TextConfig", "Gemma3ForCausalLM", **cfg)


def test_legacy_gelu_is_tanh_and_missing_gemma2_keys_take_transformers_defaults(tmp_path):
    """Gemma's released configs say hidden_act "gelu" and transformers reads it as the tanh
    GELU; a Gemma 2 config without soft-cap keys gets transformers' 50 / 30."""
    import json

    make_hf("GemmaConfig", "GemmaForCausalLM", tmp_path / "g1", **SMALL)
    path = tmp_path / "g1" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"hidden_act": "gelu"}))
    assert hf_to_llmkit(tmp_path / "g1").raw["model"]["ffn"]["approximate"] == "tanh"
    make_hf("Gemma2Config", "Gemma2ForCausalLM", tmp_path / "g2", **SMALL)
    path = tmp_path / "g2" / "config.json"
    cfg = json.loads(path.read_text())
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cfg.pop(key)
    path.write_text(json.dumps(cfg))
    model = hf_to_llmkit(tmp_path / "g2", attention="flash")
    assert model.raw["model"]["logit_softcap"] == 30.0
    assert model.spec.layers[1].attention.options.softcap == 50.0
    assert any("--attention flash has no effect" in n for n in model.notes)
    # head_dim left out: transformers' Gemma configs default to 256, not d_model / n_heads
    make_hf("GemmaConfig", "GemmaForCausalLM", tmp_path / "g3", **SMALL | {"head_dim": 256})
    path = tmp_path / "g3" / "config.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items()
                                if k != "head_dim"}))  # fmt: skip
    assert hf_to_llmkit(tmp_path / "g3").raw["model"]["head_dim"] == 256


def test_a_window_in_a_family_without_windows_is_ignored_as_transformers_does(tmp_path):
    import json

    import torch

    hf = make_hf("GemmaConfig", "GemmaForCausalLM", tmp_path, **SMALL)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"sliding_window": 4}))
    imported = hf_to_llmkit(tmp_path)
    assert {p.attention.name for p in imported.spec.layers} == {"sdpa"}
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        assert (imported.model(ids).logits - hf(ids).logits).abs().max() <= 1e-4
