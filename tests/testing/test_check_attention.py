"""llmkit.testing's attention check fails on kernels that break the contract, and whole tiny
models built with them fail the model check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmkit.contracts import AttentionKernel, NoOptions
from llmkit.errors import SpecError
from llmkit.testing import check_component, check_model_combination, reference_attention
from tests.testing.fakes import fake, fake_registry


class _Kernel(AttentionKernel):
    Options = NoOptions

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return reference_attention(
            q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask
        )


class GoodAttention(_Kernel):
    """The reference itself: passes."""


class PeekingAttention(_Kernel):
    """Ignores the causal flag: every query sees the future."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return super().forward(q, k, v, causal=False, bias=bias, key_padding_mask=key_padding_mask)


class TopLeftAttention(_Kernel):
    """Aligns queries top-left (query i sees keys 0..i), wrong when Tq < Tk."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        tq = q.shape[2]
        if causal and tq < k.shape[2]:
            mask = None if key_padding_mask is None else key_padding_mask[:, :tq]
            return super().forward(q, k[:, :, :tq], v[:, :, :tq], bias=bias, key_padding_mask=mask)
        return super().forward(q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask)


class TiledGQAAttention(_Kernel):
    """Query head h reads kv head h % Hkv (tile) instead of h // (Hq/Hkv)."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        return super().forward(q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask)


class BiasIgnoringAttention(_Kernel):
    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return super().forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask)


class PaddingIgnoringAttention(_Kernel):
    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return super().forward(q, k, v, causal=causal, bias=bias)


class NoisyAttention(_Kernel):
    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        out = super().forward(q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask)
        return out + 1e-3 * torch.randn_like(out)


class FalseWindowAttention(_Kernel):
    """Declares a cache window of 4 but attends every key."""

    cache_window = 4


class SilentCausalOnlyAttention(_Kernel):
    """Declares causal_only but quietly computes causal attention for causal=False."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return super().forward(q, k, v, bias=bias, key_padding_mask=key_padding_mask)


class UnscaledAttention(_Kernel):
    """Forgets the 1/√d scale: only the comparison with the reference notices."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        q = q * q.shape[-1] ** 0.5
        return super().forward(q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask)


class FloatAttention(_Kernel):
    """Returns float32 whatever the input dtype."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return super().forward(
            q.float(),
            k.float(),
            v.float(),
            causal=causal,
            bias=bias,
            key_padding_mask=key_padding_mask,
        )


class ParamAttention(_Kernel):
    """Has a parameter that never enters the output."""

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.temperature = nn.Parameter(torch.ones(()))


class _NonCausalBackward(torch.autograd.Function):
    """Causal forward, but a backward computed as if non-causal."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return reference_attention(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
            return torch.autograd.grad(reference_attention(q, k, v, causal=False), (q, k, v), grad)


class LeakyBackwardAttention(_Kernel):
    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        if causal and bias is None and key_padding_mask is None and q.shape[2] == k.shape[2]:
            return _NonCausalBackward.apply(q, k, v)
        return super().forward(q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask)


class DocumentAttention(_Kernel):
    """Declares document support and honours it: the reference with documents."""

    supports_document_mask = True

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None, **docs):
        return reference_attention(
            q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask, **docs
        )


class DocumentIgnoringAttention(DocumentAttention):
    """Declares document support but lets attention cross documents."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None, **docs):
        return super().forward(q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask)


class TopLeftDocumentAttention(DocumentAttention):
    """Reads the queries' documents from the first Tq ids instead of the last."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None, **docs):
        ids = docs.get("document_ids")
        tq, tk = q.shape[2], k.shape[2]
        if ids is not None and tq < tk:
            docs = {"document_ids": torch.cat([ids[:, : tk - tq], ids[:, :tq]], 1)}
        return super().forward(
            q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask, **docs
        )


class _DocumentLeakingBackward(torch.autograd.Function):
    """Forward with documents, backward as if there were none."""

    @staticmethod
    def forward(ctx, q, k, v, ids):
        ctx.save_for_backward(q, k, v)
        return reference_attention(q, k, v, document_ids=ids)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
            return *torch.autograd.grad(reference_attention(q, k, v), (q, k, v), grad), None


class DocumentLeakingBackwardAttention(DocumentAttention):
    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None, **docs):
        ids = docs.get("document_ids")
        if ids is not None and causal and bias is None and q.shape[2] == k.shape[2]:
            return _DocumentLeakingBackward.apply(q, k, v, ids)
        return super().forward(
            q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask, **docs
        )


APPROX = {"approximate": True}  # skip the reference comparison so the targeted check fires


@pytest.mark.parametrize(
    ("target", "capabilities", "match"),
    [
        (PeekingAttention, APPROX, "not causal"),
        (TopLeftAttention, APPROX, "bottom-right"),
        (TiledGQAAttention, APPROX, r"kv head h // 2"),
        (BiasIgnoringAttention, APPROX, "bias is ignored"),
        (PaddingIgnoringAttention, APPROX, "key_padding_mask"),
        (NoisyAttention, APPROX, "not deterministic"),
        (FalseWindowAttention, APPROX, "cache_window is 4"),
        (SilentCausalOnlyAttention, {**APPROX, "causal_only": True}, "causal_only"),
        (UnscaledAttention, {}, "differs from reference_attention"),
        (FloatAttention, {}, "dtype torch.float32"),
        (ParamAttention, {}, "no gradient reaches parameter 'temperature'"),
        (LeakyBackwardAttention, {}, "the gradient of q differs from reference_attention"),
        (LeakyBackwardAttention, APPROX, "backward is not causal"),
        (DocumentIgnoringAttention, APPROX, "attention must stay inside each document"),
        (TopLeftDocumentAttention, APPROX, "queries take the last Tq"),
        (DocumentLeakingBackwardAttention, {}, "document_ids: the gradient of k"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else None,
)
def test_broken_attention_fails(target, capabilities, match):
    with pytest.raises(AssertionError, match=match):
        check_component(fake("attention", target, capabilities=capabilities))


def test_good_attention_passes():
    check_component(fake("attention", GoodAttention))
    check_component(fake("attention", GoodAttention, capabilities={"gqa": False}))
    check_component(fake("attention", DocumentAttention))


# -- whole models with fake parts --------------------------------------------------------------


def test_model_check_catches_a_peeking_kernel():
    reg = fake_registry(
        {
            "kind": "attention",
            "name": "peek",
            "target": PeekingAttention,
            "capabilities": {"kv_cache": True},
        }
    )
    with pytest.raises(AssertionError, match="not causal"):
        check_model_combination("peek", "learned", "mlp", "layernorm", registry=reg)


def test_model_check_catches_a_kernel_that_breaks_kv_cache_decoding():
    reg = fake_registry(
        {
            "kind": "attention",
            "name": "topleft",
            "target": TopLeftAttention,
            "capabilities": {"kv_cache": True},
        }
    )
    with pytest.raises(AssertionError, match="KV-cache decoding"):
        check_model_combination("topleft", "learned", "mlp", "rmsnorm", registry=reg)
    # without the kv_cache capability the cache is not exercised, and the rest is fine
    reg = fake_registry({"kind": "attention", "name": "topleft", "target": TopLeftAttention})
    check_model_combination("topleft", "learned", "mlp", "rmsnorm", registry=reg)


def test_model_check_lets_spec_errors_through():
    reg = fake_registry(
        {
            "kind": "attention",
            "name": "plain",
            "target": GoodAttention,
            "capabilities": {"positions": ["embedding"], "gqa": False},
        }
    )
    with pytest.raises(SpecError, match=r"'plain'.*'alibi'|'alibi'.*'plain'"):
        check_model_combination("plain", "alibi", "mlp", "layernorm", registry=reg)
    # gqa = false: the check picks n_kv_heads = n_heads by itself
    model = check_model_combination("plain", "learned", "mlp", "layernorm", registry=reg)
    assert model.config.kv_heads == model.config.n_heads
    with pytest.raises(SpecError, match="n_kv_heads"):
        check_model_combination(
            "plain", "learned", "mlp", "layernorm", registry=reg, model={"n_kv_heads": 2}
        )
