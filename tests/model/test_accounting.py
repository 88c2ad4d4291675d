"""Accounting (llmkit.model.accounting): parameter counts of published models, FLOPs,
KV-cache bytes and training memory."""

from __future__ import annotations

import pytest
import torch

from llmkit.model import accounting, build_model
from llmkit.spec import load_spec, load_spec_dict
from tests.conftest import SPECS
from tests.helpers import tiny_spec


def meta_model(path):
    with torch.device("meta"):
        return build_model(load_spec(path))


@pytest.mark.parametrize(
    ("spec", "params"),
    [
        ("gpt2-small.toml", 124_439_808),  # GPT-2 small as released (Radford et al. 2019)
        ("llama-style.toml", 1_100_048_384),  # TinyLlama-1.1B
        ("mistral-style.toml", 7_241_732_096),  # Mistral-7B-v0.1
    ],
)
def test_parameter_counts_match_the_published_models(spec, params):
    assert meta_model(SPECS / spec).num_params() == params


def test_non_embedding_count_excludes_token_and_position_embeddings():
    model = meta_model(SPECS / "gpt2-small.toml")
    assert model.num_params(exclude_embeddings=True) == 124_439_808 - 50257 * 768 - 1024 * 768


def test_flops_per_token_follow_the_palm_formula():
    model = meta_model(SPECS / "gpt2-small.toml")
    n_matmul = 124_439_808 - 1024 * 768  # token embedding counted once as the output head
    expected_forward = 2 * n_matmul + 4 * 12 * 768 * 1024
    flops = model.flops_per_token(1024)
    assert flops["forward"] == expected_forward
    assert flops["train"] == 3 * expected_forward


def test_sliding_window_bounds_the_attention_flops_and_cache():
    dense = build_model(load_spec_dict(tiny_spec(max_seq_len=64)))
    window = build_model(
        load_spec_dict(tiny_spec(max_seq_len=64, attention={"name": "sliding_window", "window": 8}))
    )
    d, w = dense.flops_per_token(64), window.flops_per_token(64)
    assert d["forward"] - w["forward"] == 2 * 4 * 4 * 8 * (64 - 8)
    assert dense.kv_cache_bytes_per_token() == 2 * 2 * 4 * 8 * 4


def test_memory_estimate_grows_with_batch():
    model = meta_model(SPECS / "gpt2-small.toml")
    small, big = model.training_memory(1, 1024), model.training_memory(8, 1024)
    assert small["weights"] == 124_439_808 * 4
    assert big["activations"] > 7 * small["activations"]
    assert big["total"] == sum(v for k, v in big.items() if k != "total")


def test_methods_delegate_to_the_accounting_functions():
    model = build_model(load_spec_dict(tiny_spec(max_seq_len=64)))
    assert model.num_params(exclude_embeddings=True) == accounting.num_params(model, True)
    assert model.active_params() == accounting.active_params(model)
    assert model.flops_per_token(32) == accounting.flops_per_token(model, 32)
    assert model.kv_cache_bytes_per_token() == accounting.kv_cache_bytes_per_token(model)
    assert model.training_memory(2, 16) == accounting.training_memory(model, 2, 16)
