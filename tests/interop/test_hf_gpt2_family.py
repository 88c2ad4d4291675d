"""Parity with transformers for the GPT-2 family (random small configs, fp32, see hf_parity),
and the configs it refuses."""

from __future__ import annotations

import pytest

from llmkit.errors import LlmkitError
from llmkit.interop.convert import hf_to_llmkit, llmkit_to_hf
from tests.interop.hf_parity import check_export, check_family, make_hf

SMALL = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=64,
             bos_token_id=None, eos_token_id=None)  # fmt: skip


@pytest.mark.parametrize("attention", ["sdpa", "flash", "dense"])
def test_gpt2(tmp_path, attention):
    check_family(tmp_path, "GPT2Config", "GPT2LMHeadModel", attention=attention, **SMALL)


def test_gpt2_unscaled_attention_exact_gelu_n_inner_untied(tmp_path):
    cfg = SMALL | dict(scale_attn_weights=False, activation_function="gelu", n_inner=80,
                       n_head=8, tie_word_embeddings=False, layer_norm_epsilon=1e-6)  # fmt: skip
    check_family(tmp_path, "GPT2Config", "GPT2LMHeadModel", **cfg)


def test_reorder_and_upcast_attn_is_accepted(tmp_path):
    """Only how transformers' eager path computes the same scores: the model is the same."""
    make_hf("GPT2Config", "GPT2LMHeadModel", tmp_path, reorder_and_upcast_attn=True, **SMALL)
    imported = hf_to_llmkit(tmp_path)
    cfg, _ = llmkit_to_hf(imported.model, imported.spec)
    assert cfg["model_type"] == "gpt2" and cfg["reorder_and_upcast_attn"] is False


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (dict(scale_attn_by_inverse_layer_idx=True), "config scale_attn_by_inverse_layer_idx="),
        (dict(add_cross_attention=True), "config add_cross_attention=True"),
        (dict(activation_function="quick_gelu"), "activation 'quick_gelu'"),
    ],
)
def test_refused(tmp_path, setting, message):
    make_hf("GPT2Config", "GPT2LMHeadModel", tmp_path, **(SMALL | setting))
    with pytest.raises(LlmkitError, match=message) as err:
        hf_to_llmkit(tmp_path)
    assert "\n" not in str(err.value)


def test_gpt2_preset_exports_as_gpt2(tmp_path):
    model = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
    cfg = check_export(tmp_path, {"extends": "gpt2", "model": model}, "GPT2LMHeadModel")
    assert cfg["n_inner"] is None and cfg["activation_function"] == "gelu_new"
