"""Document masking: a packed row gives each of its documents the logits (and gradients) that
document gets alone, for every built-in attention kernel on its CPU paths (the Triton kernel:
tests/kernels/test_flash_document_mask.py), and the model refuses what it cannot honour."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmkit import hookimpl
from llmkit.components.attention import sliding_window as window_component
from llmkit.contracts import AttentionKernel, NoOptions
from llmkit.errors import LlmkitError
from llmkit.kernels import window_native
from llmkit.model import (
    build_model,
    document_ids_from_bounds,
    document_ids_from_eos,
    document_positions,
)
from llmkit.ops import reference_attention
from llmkit.spec import load_spec_dict
from tests.helpers import registry_with, tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (5, 11, 16)  # one packed row of three documents, 32 tokens
VOCAB = 50
KERNELS = {
    "dense": {"name": "dense"},
    "sdpa": {"name": "sdpa"},
    "flash": {"name": "flash"},  # the reference path here (no CUDA, no interpreter)
    "sliding_window": {"name": "sliding_window", "window": 8},  # shorter than a document
}


def _model(attention: dict, position: str, n_kv_heads: int = 4, **model):
    spec = tiny_spec(
        attention=attention,
        position={"name": position},
        n_kv_heads=n_kv_heads,
        vocab_size=VOCAB,
        **model,
    )
    torch.manual_seed(0)
    return build_model(load_spec_dict(spec)).eval()


def _packed(lengths=LENGTHS, batch: int = 1):
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (batch, sum(lengths)), generator=gen)
    return idx, document_ids_from_bounds([_starts(lengths)] * batch, sum(lengths))


def _starts(lengths) -> list[int]:
    return [sum(lengths[:i]) for i in range(len(lengths))]


def _alone(model, idx, lengths=LENGTHS):
    """Each document's logits run on its own, concatenated along the row."""
    return torch.cat(
        [model(idx[:, s : s + n]).logits for s, n in zip(_starts(lengths), lengths, strict=True)],
        dim=1,
    )


@pytest.mark.parametrize("position", ["rope", "alibi", "learned"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_packed_row_gives_each_document_its_own_logits(kernel, position):
    model = _model(KERNELS[kernel], position, n_kv_heads=2)  # GQA: 4 query heads, 2 kv heads
    idx, ids = _packed(batch=2)
    with torch.no_grad():
        packed = model(idx, document_ids=ids).logits
        alone = _alone(model, idx)
        plain = model(idx).logits
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    # and the masking is not a no-op: without document ids later documents see earlier ones
    assert (plain[:, LENGTHS[0] :] - alone[:, LENGTHS[0] :]).abs().max() > 1e-3


@pytest.mark.parametrize("kernel", ["dense", "sdpa"])
def test_multi_query_attention_and_one_token_documents(kernel):
    model = _model(KERNELS[kernel], "rope", n_kv_heads=1)
    lengths = (1, 7, 1, 9)
    idx, ids = _packed(lengths)
    with torch.no_grad():
        torch.testing.assert_close(
            model(idx, document_ids=ids).logits, _alone(model, idx, lengths), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("kernel", ["sdpa", "flash", "dense"])
def test_gradients_of_a_packed_row_equal_the_sum_over_its_documents(kernel):
    model = _model(KERNELS[kernel], "rope", n_kv_heads=2)
    idx, ids = _packed()
    weights = torch.randn(1, idx.shape[1], VOCAB, generator=torch.Generator().manual_seed(2))

    def grads(fn):
        model.zero_grad()
        fn().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    packed = grads(lambda: (model(idx, document_ids=ids).logits * weights).sum())
    alone = grads(lambda: (_alone(model, idx) * weights).sum())
    assert packed.keys() == alone.keys() and len(packed) > 10
    for name in packed:
        torch.testing.assert_close(packed[name], alone[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_loss_of_a_packed_row_is_the_token_weighted_loss_of_its_documents():
    model = _model(KERNELS["sdpa"], "learned")
    idx, ids = _packed()
    targets = torch.roll(idx, -1, 1)
    loss = model(idx, targets, document_ids=ids).loss
    want = F.cross_entropy(_alone(model, idx)[0], targets[0])
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)


def test_one_document_per_row_is_the_plain_forward():
    model = _model(KERNELS["sdpa"], "rope")
    idx, _ = _packed()
    with torch.no_grad():
        one = model(idx, document_ids=torch.zeros_like(idx)).logits
        torch.testing.assert_close(one, model(idx).logits, atol=1e-6, rtol=1e-6)


def test_the_sliding_window_leaves_its_compiled_kernel_for_documents(monkeypatch):
    """The C kernel knows no documents: with them, the masked path runs (and the window still
    holds inside a document longer than it), without them the C kernel where it is built."""
    calls = []
    real = window_native.window_attention_native

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(window_component.window_native, "window_attention_native", spy)
    model = _model(
        {"name": "sliding_window", "window": 4}, "rope", d_model=64, n_heads=2, n_kv_heads=2
    )  # head dim 32: the C kernel's vector width
    idx, ids = _packed()
    with torch.no_grad():
        packed = model(idx, document_ids=ids).logits
        assert calls == []
        alone = _alone(model, idx)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    if window_native.library() is not None:
        assert calls, "without documents the compiled kernel should have run"


def test_window_and_documents_on_the_kernel_match_the_reference():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 32, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 32, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    ids = document_ids_from_bounds([[5, 16], [20]], 32)
    got = window_component.sliding_window_attention(q, k, v, 6, document_ids=ids)
    want = reference_attention(q.float(), k.float(), v.float(), window=6, document_ids=ids)
    torch.testing.assert_close(got.float(), want, atol=1e-6, rtol=1e-6)
    no_docs = reference_attention(q.float(), k.float(), v.float(), window=6)
    assert (no_docs - want).abs().max() > 1e-3


def test_sdpa_with_documents_compiles_with_fullgraph():
    pytest.importorskip("torch._dynamo")
    model = _model(KERNELS["sdpa"], "rope", n_kv_heads=2)
    idx, ids = _packed()
    try:
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    except RuntimeError as exc:  # pragma: no cover - a torch build without dynamo support
        pytest.skip(f"torch.compile is unavailable: {exc}")
    with torch.no_grad():
        got = compiled(idx, document_ids=ids).logits
    torch.testing.assert_close(got, _alone(model, idx), atol=1e-5, rtol=1e-5)


# -- refusals ---------------------------------------------------------------------------------


class PlainAttention(AttentionKernel):
    """A third-party kernel that knows nothing of documents."""

    Options = NoOptions

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return reference_attention(
            q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask
        )


class PlainPlugin:
    distribution = "llmkit-plain-attention"
    name = "plain"

    @hookimpl
    def register_components(self, register):
        register("attention", "plain", PlainAttention, capabilities={"kv_cache": True})


def test_an_attention_without_document_support_is_refused_by_name():
    reg = registry_with(PlainPlugin())
    spec = tiny_spec(attention={"name": "plain"}, vocab_size=VOCAB)
    spec["model"]["overrides"] = [{"layers": [0], "attention": {"name": "sdpa"}}]
    model = build_model(load_spec_dict(spec, registry=reg)).eval()
    idx, ids = _packed()
    with pytest.raises(LlmkitError, match=r"attention 'plain' \(layer 1\).*supports_document_mask"):
        model(idx, document_ids=ids)
    model(idx)  # without document ids it runs as ever


def test_document_ids_with_a_kv_cache_are_refused():
    model = _model(KERNELS["sdpa"], "rope")
    idx, ids = _packed()
    with pytest.raises(LlmkitError, match="KV cache"):
        model(idx, document_ids=ids, cache=model.new_cache())


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        (torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2]]), "non-decreasing"),
        (torch.zeros(1, 7, dtype=torch.long), "shape"),
        (torch.zeros(1, 8), "integer"),
    ],
)
def test_bad_document_ids_are_refused(ids, error):
    model = _model(KERNELS["sdpa"], "rope")
    with pytest.raises(LlmkitError, match=error):
        model(torch.zeros(1, 8, dtype=torch.long), document_ids=ids)


# -- the helpers ------------------------------------------------------------------------------


def test_document_ids_from_eos_keeps_each_eos_in_the_document_it_ends():
    eos = 0
    idx = torch.tensor([[5, 6, 0, 7, 0, 0, 8, 9], [0, 3, 3, 3, 3, 3, 3, 0]])
    want = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]])
    got = document_ids_from_eos(idx, eos)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(document_ids_from_eos(idx[0], eos), want[0])  # (T,) too
    assert torch.equal(document_ids_from_eos(idx, 99), torch.zeros_like(idx))


def test_document_ids_from_bounds_and_positions():
    ids = document_ids_from_bounds([[3, 5], [0, 2, 8, 99], []], 6)
    assert torch.equal(
        ids, torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    )
    assert torch.equal(
        document_positions(ids),
        torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]),
    )
    real = torch.tensor([[False, True, True, True, True, True]] * 3)  # one left pad
    assert torch.equal(
        document_positions(ids, real),
        torch.tensor([[0, 0, 1, 0, 1, 0], [0, 0, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4]]),
    )


def test_the_eos_convention_end_to_end():
    """Documents found from EOS tokens: an EOS is scored with the document it ends."""
    model = _model(KERNELS["sdpa"], "rope")
    eos = 0
    docs = [torch.tensor([5, 6, 7, eos]), torch.tensor([8, 9, eos]), torch.tensor([4, 4])]
    idx = torch.cat(docs)[None]
    with torch.no_grad():
        packed = model(idx, document_ids=document_ids_from_eos(idx, eos)).logits
        alone = torch.cat([model(d[None]).logits for d in docs], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
