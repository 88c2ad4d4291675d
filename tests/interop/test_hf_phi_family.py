"""Parity with transformers for the Phi family (Phi-1/1.5/2): a parallel block with one shared
LayerNorm, partial rotary, biases everywhere including the head (random small configs, fp32,
see hf_parity)."""

from __future__ import annotations

import pytest

from llmkit.errors import LlmkitError
from llmkit.interop.convert import hf_config_for, hf_to_llmkit
from llmkit.spec import resolve
from tests.interop.hf_parity import check_family, make_hf

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=97, max_position_embeddings=128)  # fmt: skip


@pytest.mark.parametrize("attention", ["sdpa", "flash", "dense"])
def test_phi(tmp_path, attention):
    check_family(tmp_path, "PhiConfig", "PhiForCausalLM", attention=attention, **SMALL)


def test_phi_gqa_tied_exact_gelu_explicit_head_dim(tmp_path):
    cfg = SMALL | dict(num_key_value_heads=2, tie_word_embeddings=True, hidden_act="gelu",
                       head_dim=24, partial_rotary_factor=0.75, rope_theta=500.0)  # fmt: skip
    check_family(tmp_path, "PhiConfig", "PhiForCausalLM", **cfg)


def test_phi_qk_layernorm_is_refused(tmp_path):
    make_hf("PhiConfig", "PhiForCausalLM", tmp_path, qk_layernorm=True, **SMALL)
    with pytest.raises(LlmkitError, match=r"qk_layernorm=True: .* no llmkit equivalent") as err:
        hf_to_llmkit(tmp_path)
    assert "\n" not in str(err.value)


HAND_WRITTEN = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=128,
                    head_bias=True, norm={"name": "layernorm"}, block={"name": "parallel"},
                    ffn={"name": "mlp", "hidden": 96, "activation": "gelu_tanh"},
                    position={"name": "rope", "rotary_fraction": 0.5})  # fmt: skip


def test_export_picks_phi_for_a_hand_written_spec():
    _, cfg = hf_config_for(resolve({"model": HAND_WRITTEN}))
    assert (cfg["model_type"], cfg["hidden_act"]) == ("phi", "gelu_new")


def test_export_refuses_a_phi_block_without_head_bias():
    with pytest.raises(LlmkitError, match="phi: an output head without a bias") as e:
        hf_config_for(resolve({"model": HAND_WRITTEN | {"head_bias": False}}))
    assert "\n" not in str(e.value)
