"""Parity with transformers for the OPT family (random small configs, fp32, see hf_parity),
and the configs it refuses.

Exception to bit-for-bit export: the first two rows of ``embed_positions`` (OPT's offset,
never read for a real token) are not held by llmkit and are exported as zeros.
"""

from __future__ import annotations

import pytest
import torch

from llmkit.errors import LlmkitError
from llmkit.interop.convert import hf_to_llmkit, llmkit_to_hf
from tests.interop.hf_parity import (
    TOL,
    check_export,
    check_family,
    left_padded,
    make_hf,
    prompts,
)

SMALL = dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=97, max_position_embeddings=64, pad_token_id=1, bos_token_id=2,
             eos_token_id=2)  # fmt: skip
OFFSET_ROWS = {"model.decoder.embed_positions.weight": 2}


def check(tmp_path, **cfg):
    check_family(tmp_path, "OPTConfig", "OPTForCausalLM", unkept_rows=OFFSET_ROWS, **cfg)


@pytest.mark.parametrize("attention", ["sdpa", "flash", "dense"])
def test_opt_pre_norm(tmp_path, attention):
    check(tmp_path, attention=attention, **SMALL)


@pytest.mark.parametrize("attention", ["sdpa", "dense"])
def test_opt_post_norm(tmp_path, attention):
    """OPT-350m's layout: LayerNorm after each residual sum, no final LayerNorm."""
    check(tmp_path, attention=attention, **(SMALL | dict(do_layer_norm_before=False)))


def test_opt_without_biases_untied_gelu(tmp_path):
    cfg = SMALL | dict(enable_bias=False, tie_word_embeddings=False, activation_function="gelu")
    check(tmp_path, **cfg)


def test_opt_layer_norm_without_affine(tmp_path):
    check(tmp_path, **(SMALL | dict(layer_norm_elementwise_affine=False)))


def test_opt_without_final_norm(tmp_path):
    check(tmp_path, **(SMALL | dict(_remove_final_layer_norm=True)))


def test_export_refuses_a_gain_a_bias_free_layernorm_cannot_hold(tmp_path):
    cfg = SMALL | dict(layer_norm_elementwise_affine=False)
    make_hf("OPTConfig", "OPTForCausalLM", tmp_path, **cfg)
    imported = hf_to_llmkit(tmp_path)
    with torch.no_grad():
        imported.model.layers[1].norm2.weight[3] = 2.0
    with pytest.raises(LlmkitError, match=r"layers\.1\.norm2\.weight is not all ones"):
        llmkit_to_hf(imported.model, imported.spec)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (dict(word_embed_proj_dim=32), "config word_embed_proj_dim=32 differs from hidden_size"),
        (dict(activation_function="quick_gelu"), "activation 'quick_gelu'"),
    ],
)
def test_refused(tmp_path, setting, message):
    make_hf("OPTConfig", "OPTForCausalLM", tmp_path, **(SMALL | setting))
    with pytest.raises(LlmkitError, match=message) as err:
        hf_to_llmkit(tmp_path)
    assert "\n" not in str(err.value)


@torch.no_grad()
def test_left_padding_positions_from_the_mask(tmp_path):
    """OPT derives positions from the attention mask itself (no position_ids given): the
    real tokens before each token, as llmkit does."""
    hf_model = make_hf("OPTConfig", "OPTForCausalLM", tmp_path, **SMALL)
    ours = hf_to_llmkit(tmp_path).model
    ids, mask = left_padded(prompts(SMALL["vocab_size"]))
    theirs = hf_model(input_ids=ids, attention_mask=mask).logits
    mine = ours(ids, key_padding_mask=mask.bool()).logits
    assert (theirs - mine).abs()[mask.bool()].max().item() <= TOL


@pytest.mark.parametrize(
    "changes",
    [
        {"ffn": {"name": "mlp", "activation": "relu"}},  # GPT-2 could hold it but for ReLU
        {"block": {"name": "post_norm"}, "final_norm": False},
        {"bias": False},  # and LayerNorms without bias, gains 1
    ],
)
def test_llmkit_models_gpt2_cannot_hold_export_as_opt(tmp_path, changes):
    model = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=64) | changes
    check_export(tmp_path, {"extends": "gpt2", "model": model}, "OPTForCausalLM")
