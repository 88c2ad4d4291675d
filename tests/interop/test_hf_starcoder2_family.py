"""Parity with transformers for Starcoder2: LayerNorm pre-norm blocks, rotary GQA attention with
biases, a GELU (tanh) MLP, a sliding window on every layer, a tied head (random small configs,
fp32, see hf_parity)."""

from __future__ import annotations

import pytest

from llmkit.errors import LlmkitError
from llmkit.interop.convert import hf_config_for, hf_to_llmkit
from llmkit.spec import resolve
from tests.interop.hf_parity import check_family, make_hf

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=128,
             bos_token_id=1, eos_token_id=2)  # fmt: skip


@pytest.mark.parametrize("attention", ["sdpa", "flash", "dense"])
def test_starcoder2_full_attention(tmp_path, attention):
    check_family(tmp_path, "Starcoder2Config", "Starcoder2ForCausalLM", attention=attention,
                 **SMALL)  # fmt: skip


def test_starcoder2_window_shorter_than_the_prompts(tmp_path):
    check_family(tmp_path, "Starcoder2Config", "Starcoder2ForCausalLM", lengths=(13, 3, 20),
                 sliding_window=8, **SMALL)  # fmt: skip
    attention = hf_to_llmkit(tmp_path / "hf").spec.layers[1].attention
    assert (attention.name, attention.options.window) == ("sliding_window", 8)


def test_starcoder2_without_biases_untied_explicit_head_dim(tmp_path):
    cfg = SMALL | dict(use_bias=False, tie_word_embeddings=False, head_dim=24,
                       hidden_act="gelu", rope_theta=500.0)  # fmt: skip
    check_family(tmp_path, "Starcoder2Config", "Starcoder2ForCausalLM", **cfg)


def test_starcoder2_partial_rotary_is_refused(tmp_path):
    make_hf("Starcoder2Config", "Starcoder2ForCausalLM", tmp_path, partial_rotary_factor=0.5,
            **SMALL)  # fmt: skip
    with pytest.raises(LlmkitError, match="Starcoder2 rotates the whole head") as e:
        hf_to_llmkit(tmp_path)
    assert "\n" not in str(e.value)


HAND_WRITTEN = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    max_seq_len=128, norm={"name": "layernorm"},
                    ffn={"name": "mlp", "hidden": 96, "activation": "gelu_tanh"},
                    position={"name": "rope"},
                    attention={"name": "sliding_window", "window": 8})  # fmt: skip


def test_export_picks_starcoder2_for_a_hand_written_spec():
    _, cfg = hf_config_for(resolve({"model": HAND_WRITTEN}))
    assert (cfg["model_type"], cfg["sliding_window"]) == ("starcoder2", 8)


def test_export_refuses_a_window_on_some_layers_only():
    window = {"layers": [1], "attention": HAND_WRITTEN["attention"]}
    spec = HAND_WRITTEN | {"attention": {"name": "sdpa"}, "overrides": [window]}
    with pytest.raises(LlmkitError, match="starcoder2 windows every layer") as e:
        hf_config_for(resolve({"model": spec}))
    assert "\n" not in str(e.value)
