"""The model-level options real architectures need (q/k/v and output biases, a head bias, an
embedding scale, a softmax scale, logit soft-capping) and the component options added with
them (RMSNorm's gain offset, output-only sandwich norms, dense soft-capping), each checked
against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llmkit.contracts import AttentionInputs
from llmkit.model import build_model
from llmkit.spec import resolve


def model(**options):
    base = {"vocab_size": 50, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32}
    torch.manual_seed(0)
    return build_model(resolve({"model": base | options})).eval()


def test_qkv_and_output_biases_are_separate():
    m = model(bias=False, qkv_bias=True)
    attn = m.layers[0].attn
    assert attn.qkv.bias is not None and attn.out_proj.bias is None
    m = model(bias=True, attn_out_bias=False)
    assert m.layers[0].attn.qkv.bias is not None and m.layers[0].attn.out_proj.bias is None


def test_head_bias_is_added_to_the_logits():
    m = model(head_bias=True, tie_embeddings=True)
    ids = torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        before = m(ids).logits
        m.lm_head.bias.fill_(0.5)
        assert torch.allclose(m(ids).logits, before + 0.5, atol=1e-6)


def test_embedding_scale_multiplies_the_embeddings():
    ids = torch.randint(0, 50, (2, 6))
    plain, scaled = (
        model(position={"name": "none"}),
        model(position={"name": "none"}, embedding_scale="sqrt_d_model"),
    )
    scaled.load_state_dict(plain.state_dict())
    seen = {}
    plain.layers[0].register_forward_pre_hook(lambda _m, a: seen.update(plain=a[0]))
    scaled.layers[0].register_forward_pre_hook(lambda _m, a: seen.update(scaled=a[0]))
    with torch.no_grad():
        plain(ids), scaled(ids)
    assert torch.allclose(seen["scaled"], seen["plain"] * math.sqrt(32))


def test_logit_softcap_bounds_the_logits():
    m = model(logit_softcap=0.5)
    with torch.no_grad():
        m.lm_head.weight.mul_(100)
        logits = m(torch.randint(0, 50, (1, 7))).logits
    assert logits.abs().max() <= 0.5 and logits.abs().min() < 0.5
    uncapped = model()
    uncapped.load_state_dict(m.state_dict())
    with torch.no_grad():
        ids = torch.randint(0, 50, (1, 7))
        assert torch.allclose(m(ids).logits, 0.5 * torch.tanh(uncapped(ids).logits / 0.5))


@pytest.mark.parametrize("attention", ["sdpa", "dense", "flash"])
def test_attn_scale_is_the_softmax_scale(attention):
    q, k, v = (torch.randn(1, 4, 6, 8) for _ in range(3))
    m = model(attn_scale=0.3, attention={"name": attention})
    attn = m.layers[0].attn
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    got = attn.kernel(q * attn.q_multiplier, k, v, causal=True)
    assert torch.allclose(got, expected, atol=1e-5)
    assert attn.q_multiplier == pytest.approx(0.3 * math.sqrt(8))


def test_rmsnorm_offset_is_a_gain_of_one_plus_w():
    m = model(norm={"name": "rmsnorm", "offset": 1.0})
    norm = m.norm_f
    assert torch.equal(norm.weight, torch.zeros(32))  # gain 1 at init
    x = torch.randn(3, 32)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
        want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight)
        assert torch.allclose(norm(x), want, atol=1e-5)


def test_sandwich_without_input_norms_normalizes_outputs_only():
    m = model(block={"name": "sandwich", "input_norms": False}, norm={"name": "rmsnorm"})
    block = m.layers[0]
    x = torch.randn(1, 5, 32)
    seen = {}
    block.attn.register_forward_pre_hook(lambda _m, a: seen.update(attn_in=a[0]))
    inputs = AttentionInputs(m.position, torch.arange(5))
    with torch.no_grad():
        out = block(x, inputs)
        h = x + block.attn_post_norm(block.attn(x, inputs))
        assert torch.equal(seen["attn_in"], x)  # no norm on the way in
        assert torch.allclose(out, h + block.ffn_post_norm(block.ffn(h)), atol=1e-6)
    assert not any(n.startswith(("norm1", "norm2")) for n, _ in block.named_parameters())


def test_dense_softcap_caps_the_scores_before_the_mask():
    from llmkit.ops import reference_attention

    q, k, v = (torch.randn(1, 2, 5, 4) * 3 for _ in range(3))
    got = reference_attention(q, k, v, softcap=1.5)
    scores = q @ k.transpose(-1, -2) / 2.0
    scores = 1.5 * torch.tanh(scores / 1.5)
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(got, scores.softmax(-1) @ v, atol=1e-5)
