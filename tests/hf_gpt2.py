"""A GPT-2-style llmkit model copied into Hugging Face's ``GPT2LMHeadModel`` (built locally,
no download), for comparisons with what users would otherwise run: transformers'
``generate()`` (benchmarks/inference/test_generate.py) and lm-eval-harness's ``hf`` model
(tests/evaluation/test_lm_eval_parity.py).

Our fused qkv ``Linear`` weight is (3·d, d) in q, k, v order; HF's ``Conv1D`` stores
(d, 3·d), so weights are transposed.
"""

from __future__ import annotations

import torch

from llmkit.model import Transformer


def gpt2_spec(d: int, layers: int, heads: int, vocab: int, seq: int) -> dict:
    return {
        "extends": "gpt2",
        "model": {
            "vocab_size": vocab,
            "d_model": d,
            "n_layers": layers,
            "n_heads": heads,
            "max_seq_len": seq,
            "ffn": {"name": "mlp", "activation": "gelu_tanh", "multiplier": 4.0},
        },
    }


@torch.no_grad()
def to_hf_gpt2(model: Transformer):
    """A ``GPT2LMHeadModel`` holding ``model``'s weights (GPT-2-style specs only)."""
    m = model.config
    cfg = _transformers().GPT2Config(
        vocab_size=m.vocab_size,
        n_positions=m.max_seq_len,
        n_embd=m.d_model,
        n_layer=m.n_layers,
        n_head=m.n_heads,
        activation_function="gelu_new",
        layer_norm_epsilon=model.norm_f.eps if hasattr(model.norm_f, "eps") else 1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=True,
    )
    hf = _transformers().GPT2LMHeadModel(cfg).eval()
    t = hf.transformer
    t.wte.weight.copy_(model.tok_emb.weight)
    t.wpe.weight.copy_(model.position.wpe.weight)
    for ours, theirs in zip(model.layers, t.h):
        pairs = [
            (theirs.ln_1, ours.norm1, False),
            (theirs.ln_2, ours.norm2, False),
            (theirs.attn.c_attn, ours.attn.qkv, True),
            (theirs.attn.c_proj, ours.attn.out_proj, True),
            (theirs.mlp.c_fc, ours.ffn.in_proj, True),
            (theirs.mlp.c_proj, ours.ffn.out_proj, True),
        ]
        for dst, src, conv1d in pairs:
            dst.weight.copy_(src.weight.T if conv1d else src.weight)
            dst.bias.copy_(src.bias)
    t.ln_f.weight.copy_(model.norm_f.weight)
    t.ln_f.bias.copy_(model.norm_f.bias)
    hf.lm_head.weight = t.wte.weight
    return hf


def _transformers():
    import transformers

    return transformers
