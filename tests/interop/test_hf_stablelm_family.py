"""Parity with transformers for the StableLM family: LayerNorm, partial rotary, GQA, a gated MLP,
pre-norm or parallel blocks with one shared norm (random small configs, fp32, see hf_parity)."""

from __future__ import annotations

import pytest

from llmkit.errors import LlmkitError
from llmkit.interop.convert import hf_config_for, hf_to_llmkit
from llmkit.spec import resolve
from tests.interop.hf_parity import check_family, make_hf

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=128)  # fmt: skip


@pytest.mark.parametrize("attention", ["sdpa", "flash", "dense"])
def test_stablelm_sequential_untied(tmp_path, attention):
    check_family(tmp_path, "StableLmConfig", "StableLmForCausalLM", attention=attention, **SMALL)


def test_stablelm_parallel_tied_qkv_bias(tmp_path):
    cfg = SMALL | dict(use_parallel_residual=True, tie_word_embeddings=True, use_qkv_bias=True,
                       partial_rotary_factor=0.5, rope_theta=500.0)  # fmt: skip
    check_family(tmp_path, "StableLmConfig", "StableLmForCausalLM", **cfg)


def test_stablelm_gelu_gate_is_geglu(tmp_path):
    cfg = SMALL | dict(hidden_act="gelu_pytorch_tanh", num_key_value_heads=4)
    check_family(tmp_path, "StableLmConfig", "StableLmForCausalLM", **cfg)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (dict(qk_layernorm=True), "qk_layernorm=True: .* no llmkit equivalent"),
        (dict(hidden_act="relu"), "hidden_act 'relu': llmkit's gated MLPs use SiLU or GELU"),
    ],
)
def test_stablelm_refused(tmp_path, setting, message):
    make_hf("StableLmConfig", "StableLmForCausalLM", tmp_path, **(SMALL | setting))
    with pytest.raises(LlmkitError, match=message) as err:
        hf_to_llmkit(tmp_path)
    assert "\n" not in str(err.value)


HAND_WRITTEN = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    max_seq_len=128, bias=False, tie_embeddings=False,
                    norm={"name": "layernorm", "bias": True}, block={"name": "parallel"},
                    ffn={"name": "swiglu", "hidden": 96},
                    position={"name": "rope", "rotary_fraction": 0.25})  # fmt: skip


def test_export_picks_stablelm_for_a_hand_written_spec():
    _, cfg = hf_config_for(resolve({"model": HAND_WRITTEN}))
    assert (cfg["model_type"], cfg["use_parallel_residual"]) == ("stablelm", True)


def test_export_refuses_a_stablelm_block_with_an_output_bias():
    with pytest.raises(LlmkitError, match="stablelm: a bias on the attention output") as e:
        hf_config_for(resolve({"model": HAND_WRITTEN | {"attn_out_bias": True}}))
    assert "\n" not in str(e.value)
