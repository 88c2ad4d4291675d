"""Parity with transformers for the GPT-NeoX family: parallel (two norms) and sequential
blocks, partial rotary, fused per-head q/k/v rows (random small configs, fp32, see hf_parity)."""

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
def test_neox_parallel(tmp_path, attention):
    check_family(tmp_path, "GPTNeoXConfig", "GPTNeoXForCausalLM", attention=attention, **SMALL)


def test_neox_sequential_tied_no_attention_bias_full_rotary(tmp_path):
    cfg = SMALL | dict(use_parallel_residual=False, tie_word_embeddings=True,
                       attention_bias=False, rotary_pct=1.0, rotary_emb_base=500.0)  # fmt: skip
    check_family(tmp_path, "GPTNeoXConfig", "GPTNeoXForCausalLM", **cfg)


def test_neox_unknown_activation_is_refused(tmp_path):
    make_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", tmp_path, hidden_act="quick_gelu", **SMALL)
    with pytest.raises(LlmkitError, match="activation 'quick_gelu' has no llmkit equivalent") as e:
        hf_to_llmkit(tmp_path)
    assert "\n" not in str(e.value)


HAND_WRITTEN = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=128,
                    tie_embeddings=False, norm={"name": "layernorm"},
                    block={"name": "parallel", "shared_norm": False},
                    ffn={"name": "mlp", "hidden": 96},
                    position={"name": "rope", "rotary_fraction": 0.25})  # fmt: skip


def test_export_picks_neox_for_a_hand_written_spec():
    _, cfg = hf_config_for(resolve({"model": HAND_WRITTEN}))
    assert (cfg["model_type"], cfg["use_parallel_residual"]) == ("gpt_neox", True)
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_export_refuses_grouped_query_attention_in_a_neox_block():
    with pytest.raises(LlmkitError, match="GPT-NeoX has no grouped-query attention") as e:
        hf_config_for(resolve({"model": HAND_WRITTEN | {"n_kv_heads": 2}}))
    assert "\n" not in str(e.value)
