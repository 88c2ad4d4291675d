"""Parity with transformers for the Llama family: Llama, Mistral, Mixtral, Qwen2, Qwen3,
Qwen3-MoE (random small configs, fp32, see hf_parity)."""

from __future__ import annotations

import pytest

from tests.interop.hf_parity import check_family

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=128)  # fmt: skip


@pytest.mark.parametrize("attention", ["sdpa", "flash", "dense"])
def test_llama_gqa_untied(tmp_path, attention):
    check_family(tmp_path, "LlamaConfig", "LlamaForCausalLM", attention=attention, **SMALL)


def test_llama_mqa_tied_explicit_head_dim_with_biases(tmp_path):
    cfg = SMALL | dict(num_key_value_heads=1, head_dim=24, tie_word_embeddings=True,
                       attention_bias=True, mlp_bias=True, rope_theta=500000.0)  # fmt: skip
    check_family(tmp_path, "LlamaConfig", "LlamaForCausalLM", **cfg)


@pytest.mark.parametrize("attention", ["sdpa", "sliding_window", "dense"])
def test_mistral_window_shorter_than_the_prompts(tmp_path, attention):
    # sequences of 19 tokens (+32 generated) against a window of 8: the window matters
    cfg = SMALL | dict(sliding_window=8)
    check_family(tmp_path, "MistralConfig", "MistralForCausalLM", attention=attention, **cfg)


def test_mixtral_top2(tmp_path):
    cfg = SMALL | dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
    check_family(tmp_path, "MixtralConfig", "MixtralForCausalLM", **cfg)


def test_qwen2_qkv_bias_without_output_bias(tmp_path):
    cfg = SMALL | dict(tie_word_embeddings=True)
    check_family(tmp_path, "Qwen2Config", "Qwen2ForCausalLM", attention="flash", **cfg)


def test_qwen2_window_on_the_last_layers(tmp_path):
    cfg = SMALL | dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=6,
                       max_window_layers=1)  # fmt: skip
    check_family(tmp_path, "Qwen2Config", "Qwen2ForCausalLM", **cfg)


@pytest.mark.parametrize("attention", ["sdpa", "flash", "sliding_window"])
def test_qwen3_qk_norm_before_rope(tmp_path, attention):
    cfg = SMALL | dict(head_dim=32)
    check_family(tmp_path, "Qwen3Config", "Qwen3ForCausalLM", attention=attention, **cfg)


@pytest.mark.parametrize("renormalize", [False, True])
def test_qwen3_moe_top_k_of_the_full_softmax(tmp_path, renormalize):
    cfg = SMALL | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       norm_topk_prob=renormalize, mlp_only_layers=[0])  # fmt: skip
    check_family(tmp_path, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", **cfg)


def test_qwen2_moe_gated_shared_expert(tmp_path):
    cfg = SMALL | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40)  # fmt: skip
    check_family(tmp_path, "Qwen2MoeConfig", "Qwen2MoeForCausalLM", **cfg)


ROPE_SCALING = {
    "llama3": dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "linear": dict(rope_type="linear", factor=2.0),
    "longrope": dict(rope_type="longrope", original_max_position_embeddings=16,
                     short_factor=[1.0 + i / 16 for i in range(8)],
                     long_factor=[1.5 + i / 8 for i in range(8)]),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(ROPE_SCALING))
def test_llama_rope_scaling_past_the_original_context(tmp_path, kind):
    # prompts of 19 tokens + 32 new ones cross the original context of 16
    params = {"rope_theta": 10000.0, **ROPE_SCALING[kind]}
    cfg = SMALL | dict(max_position_embeddings=64, rope_parameters=params)
    check_family(tmp_path, "LlamaConfig", "LlamaForCausalLM", lengths=(19, 5, 12), **cfg)


def test_llama_dynamic_ntk_while_the_sequence_grows(tmp_path):
    # HF's dynamic NTK takes max_position_embeddings as the original context: 24 here, which
    # the prompts (19) stay under and generation (19 + 32) passes; llmkit's context is 3 × 24
    params = {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 3.0}
    cfg = SMALL | dict(max_position_embeddings=24, rope_parameters=params)
    check_family(tmp_path, "LlamaConfig", "LlamaForCausalLM", lengths=(19, 5, 12), **cfg)


def test_a_bias_the_chosen_model_type_has_no_place_for_is_refused():
    # transformers reads attention_bias only in Llama and Qwen3(-MoE), mlp_bias only in Llama:
    # a Mistral (window), Qwen3 (q/k norm) or Qwen2 (q/k/v bias) config would drop them.
    from llmkit.interop.families.llama import FAMILY
    from llmkit.interop.family import Refused
    from llmkit.spec import resolve

    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                bias=False, norm={"name": "rmsnorm", "eps": 1e-5}, position={"name": "rope"},
                ffn={"name": "swiglu", "hidden": 48})  # fmt: skip
    window = {"attention": {"name": "sliding_window", "window": 8}}
    mlp_bias = {"ffn": {"name": "swiglu", "hidden": 48, "bias": True}}
    refused = {
        "attention biases: transformers' mistral": window | {"attn_out_bias": True},
        "an MLP bias: transformers' mistral": window | mlp_bias,
        "an MLP bias: transformers' qwen3": {"qk_transform": {"name": "rmsnorm"}} | mlp_bias,
        "an MLP bias: transformers' qwen2": {"qkv_bias": True, "attn_out_bias": False} | mlp_bias,
    }
    for reason, change in refused.items():
        with pytest.raises(Refused, match=reason):
            FAMILY.hf_config(resolve({"model": base | change}))
    all_biases = {"qkv_bias": True, "attn_out_bias": True}
    held = FAMILY.hf_config(resolve({"model": base | mlp_bias | all_biases}))
    assert held["model_type"] == "llama" and held["mlp_bias"] and held["attention_bias"]
    qwen3 = FAMILY.hf_config(resolve({"model": base | {"qk_transform": {"name": "rmsnorm"}}}))
    assert qwen3["model_type"] == "qwen3" and "mlp_bias" not in qwen3


def test_import_ignores_bias_keys_the_model_type_does_not_read(tmp_path):
    # A Mistral config saying attention_bias/mlp_bias: transformers builds no biases.
    cfg = SMALL | dict(sliding_window=8, attention_bias=True, mlp_bias=True)
    check_family(tmp_path, "MistralConfig", "MistralForCausalLM", **cfg)


def test_the_source_dtype_is_the_one_most_weights_have(tmp_path):
    # No dtype in config.json, float32 matrices and bfloat16 norms: the checkpoint is float32
    # (export --dtype auto writes it back as such).
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from llmkit.interop.convert import hf_to_llmkit
    from tests.interop.hf_parity import make_hf

    make_hf("LlamaConfig", "LlamaForCausalLM", tmp_path, **SMALL)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (weights,) = tmp_path.glob("*.safetensors")
    tensors = load_file(weights)
    tensors = {k: v.to(torch.bfloat16) if "norm" in k else v for k, v in tensors.items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    assert hf_to_llmkit(tmp_path).source_dtype == "float32"
