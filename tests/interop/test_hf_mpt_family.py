"""Parity with transformers for the MPT family (random small configs, fp32, see hf_parity),
ALiBi slopes for head counts that are not powers of two, and the configs it refuses."""

from __future__ import annotations

import pytest
import torch

from llmkit.components.position.alibi import alibi_slopes
from llmkit.errors import LlmkitError
from llmkit.interop.convert import hf_to_llmkit
from tests.interop.hf_parity import check_export, check_family, make_hf

SMALL = dict(d_model=64, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=64)


@pytest.mark.parametrize(
    ("attention", "heads", "d_model"),
    [("sdpa", 4, 64), ("flash", 6, 96), ("dense", 3, 48), ("sdpa", 12, 96)],
)
def test_mpt(tmp_path, attention, heads, d_model):
    """Head counts that are not powers of two take ALiBi slopes from two sequences."""
    cfg = SMALL | dict(n_heads=heads, d_model=d_model)
    check_family(tmp_path, "MptConfig", "MptForCausalLM", attention=attention, **cfg)


def test_mpt_softmax_scale_untied_eps(tmp_path):
    cfg = SMALL | dict(attn_config={"softmax_scale": 0.5, "attn_uses_sequence_id": True},
                       tie_word_embeddings=False, layer_norm_epsilon=1e-6)  # fmt: skip
    check_family(tmp_path, "MptConfig", "MptForCausalLM", attention="dense", **cfg)


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 7, 12, 20, 24])
def test_alibi_slopes_match_transformers(heads):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    theirs = build_mpt_alibi_tensor(heads, 2)[:, 0, 0]  # the bias of distance 1: −slope
    ours = torch.tensor(alibi_slopes(heads, 8.0), dtype=torch.float32)
    torch.testing.assert_close(-theirs, ours, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (dict(no_bias=False), "config no_bias=False: transformers' MptForCausalLM ignores"),
        (dict(expansion_ratio=2), "config expansion_ratio=2: "),
        (dict(logit_scale=0.5), "config logit_scale=0.5: "),
        (dict(attn_config={"alibi": False}), "config attn_config.alibi=False: "),
        (dict(attn_config={"alibi_bias_max": 16}), "config attn_config.alibi_bias_max=16: "),
        (dict(attn_config={"clip_qkv": 6.0}), "config attn_config.clip_qkv=6.0: q/k/v clamp"),
        (dict(attn_config={"qk_ln": True}), "config attn_config.qk_ln=True: "),
        (dict(attn_config={"prefix_lm": True}), "config attn_config.prefix_lm=True: "),
        (
            dict(attn_config={"attn_type": "multiquery_attention"}),
            "config attn_config.attn_type='multiquery_attention': ",
        ),
    ],
)
def test_refused(tmp_path, setting, message):
    make_hf("MptConfig", "MptForCausalLM", tmp_path, **(SMALL | setting))
    with pytest.raises(LlmkitError, match=message) as err:
        hf_to_llmkit(tmp_path)
    assert "\n" not in str(err.value)


def _alibi_spec(max_bias: float) -> dict:
    return {"model": dict(vocab_size=97, n_layers=2, n_heads=12, max_seq_len=64, d_model=96,
                          bias=False, position={"name": "alibi", "max_bias": max_bias},
                          ffn={"name": "mlp", "activation": "gelu"})}  # fmt: skip


def test_llmkit_alibi_model_exports_as_mpt(tmp_path):
    check_export(tmp_path, _alibi_spec(8.0), "MptForCausalLM")


def test_export_refuses_alibi_max_bias_transformers_ignores(tmp_path):
    with pytest.raises(LlmkitError, match=r"mpt: ALiBi max_bias 16\.0 \(transformers' MPT"):
        check_export(tmp_path, _alibi_spec(16.0), "MptForCausalLM")
