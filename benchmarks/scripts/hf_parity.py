"""Print the logit gaps between llmkit and transformers for one small random config of every
supported family (the parity tests' checks, measured): max |Δlogit| on a batch, on left-padded
prompts, and after export and reload in transformers; greedy decoding of 32 tokens with
llmkit's KV cache is asserted identical.

    python -m benchmarks.scripts.hf_parity
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from tests.interop.hf_parity import check_family

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97, max_position_embeddings=128)  # fmt: skip
MHA = BASE | dict(num_key_value_heads=4)
CASES = [
    ("GPT2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=64), {}),
    ("OPT", dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                 vocab_size=97, max_position_embeddings=64, word_embed_proj_dim=64),
     {"unkept_rows": {"model.decoder.embed_positions.weight": 2}}),
    ("Llama", BASE, {}),
    ("Mistral", BASE | dict(sliding_window=8), {}),
    ("Mixtral", BASE | dict(num_local_experts=4, num_experts_per_tok=2), {}),
    ("Qwen2", BASE, {}),
    ("Qwen2Moe", BASE | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                             shared_expert_intermediate_size=40), {}),
    ("Qwen3", BASE | dict(head_dim=32), {}),
    ("Qwen3Moe", BASE | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                             norm_topk_prob=True), {}),
    ("Gemma", BASE | dict(num_key_value_heads=1, head_dim=32), {}),
    ("Gemma2", BASE | dict(head_dim=32, sliding_window=6, query_pre_attn_scalar=24,
                           attn_logit_softcapping=5.0, final_logit_softcapping=3.0), {}),
    ("Gemma3Text", BASE | dict(num_hidden_layers=3, head_dim=32, sliding_window=6,
                               layer_types=["sliding_attention"] * 2 + ["full_attention"],
                               query_pre_attn_scalar=24), {}),
    ("GPTNeoX", MHA, {}),
    ("Phi", MHA, {}),
    ("StableLm", MHA, {}),
    ("Starcoder2", BASE | dict(sliding_window=8), {}),
    ("Mpt", dict(d_model=64, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=64), {}),
]  # fmt: skip
MODEL_CLASS = {"GPT2": "GPT2LMHeadModel", "Gemma3Text": "Gemma3ForCausalLM"}


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'family':<11} {'logits':>9} {'padded':>9} {'exported':>9}  greedy x32")
    for name, config, extra in CASES:
        model_cls = MODEL_CLASS.get(name, f"{name}ForCausalLM")
        with tempfile.TemporaryDirectory() as tmp:
            gaps = check_family(Path(tmp), f"{name}Config", model_cls, **extra, **config)
        print(
            f"{name:<11} {gaps['logits']:9.1e} {gaps['left_padded']:9.1e} "
            f"{gaps['exported']:9.1e}  identical"
        )


if __name__ == "__main__":
    main()
