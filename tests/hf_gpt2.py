"""A GPT-2-style llmkit model as Hugging Face's ``GPT2LMHeadModel`` (built locally, no
download) through llmkit's own export (:func:`llmkit.interop.to_transformers`), for comparisons
with what users would otherwise run: transformers' ``generate()``
(benchmarks/inference/test_generate.py) and lm-eval-harness's ``hf`` model
(tests/evaluation/test_lm_eval_parity.py)."""

from __future__ import annotations

from llmkit.interop.convert import to_transformers
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


def to_hf_gpt2(model: Transformer):
    """A ``GPT2LMHeadModel`` holding ``model``'s weights (GPT-2-style specs only)."""
    hf = to_transformers(model)
    if type(hf).__name__ != "GPT2LMHeadModel":
        raise ValueError(f"not a GPT-2-style model: exported as {type(hf).__name__}")
    return hf
