"""The KV cache: every registered attention × position pair decodes incrementally exactly as
the full forward (prompt, chunk, then token by token; with and without left padding),
sliding windows keep a rolling buffer whose memory does not grow, buffers are preallocated,
and models whose components cannot cache still generate."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from llmkit import hookimpl
from llmkit.components.attention.sdpa import SDPAttention
from llmkit.errors import SpecError
from llmkit.inference import Sampling, generate_batch, prepare_for_decoding
from llmkit.model import KVCache, LayerCache, build_model
from llmkit.registry import get_registry
from llmkit.spec import load_spec_dict
from tests.helpers import registry_with, tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")


#: Windows smaller than the sequence, so the rolling buffer wraps several times.
OPTIONS = {"sliding_window": {"window": 3}}
T = 20  # > 2·window + slack: every windowed buffer compacts at least twice
ATOL = 2e-5


def _names(kind: str) -> list[str]:
    return [c.name for c in get_registry().list(kind)]


PAIRS = list(itertools.product(_names("attention"), _names("position")))


def _model(attention: str, position: str, **model):
    spec = tiny_spec(
        attention={"name": attention, **OPTIONS.get(attention, {})},
        position={"name": position},
        n_kv_heads=2,
        max_seq_len=32,
        **model,
    )
    try:
        rs = load_spec_dict(spec)
    except SpecError as exc:
        pytest.skip(f"refused at validation: {exc}")
    torch.manual_seed(0)
    return build_model(rs).eval()


def test_every_registered_pair_is_covered():
    assert len(PAIRS) >= 3 * 5
    assert ("sliding_window", "alibi") in PAIRS


@pytest.mark.parametrize(("attention", "position"), PAIRS, ids=["-".join(p) for p in PAIRS])
def test_incremental_decoding_equals_the_full_forward(attention, position):
    model = _model(attention, position)
    if not model.supports_kv_cache:
        pytest.skip("declares kv_cache = false (the fallback is tested below)")
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (2, T), generator=gen)
    with torch.no_grad():
        full = model(idx).logits
        prepare_for_decoding(model)  # and decode in the layout `llmkit generate` uses
        cache = model.new_cache()
        pieces = [(0, 5), (5, 8)] + [(t, t + 1) for t in range(8, T)]
        inc = torch.cat([model(idx[:, a:b], cache=cache).logits for a, b in pieces], 1)
    torch.testing.assert_close(inc, full, atol=ATOL, rtol=1e-4)
    assert cache.position == T
    window = model.layers[0].attn.kernel.cache_window
    for layer in cache.layers:
        assert layer.length == (min(window, T) if window else T)


@pytest.mark.parametrize(("attention", "position"), PAIRS, ids=["-".join(p) for p in PAIRS])
def test_left_padded_batch_decodes_like_each_row_alone(attention, position):
    """Rows of different lengths, left-padded and masked: the prompt's last logits and every
    cached decoding step equal those of the row run alone (positions restart per row)."""
    model = _model(attention, position)
    gen = torch.Generator().manual_seed(2)
    lengths, width, steps = [9, 4, 1], 9, 6
    rows = [torch.randint(0, 64, (n,), generator=gen) for n in lengths]
    follow = torch.randint(0, 64, (len(rows), steps), generator=gen)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, True
    with torch.no_grad():
        if model.supports_kv_cache:
            cache = model.new_cache()
            out = [model(ids, cache=cache, key_padding_mask=mask).logits[:, -1:]]
            out += [model(follow[:, t : t + 1], cache=cache).logits for t in range(steps)]
        else:
            full_ids = torch.cat([ids, follow], 1)
            full_mask = torch.cat([mask, torch.ones_like(follow, dtype=torch.bool)], 1)
            logits = model(full_ids, key_padding_mask=full_mask).logits
            out = [logits[:, width - 1 :]]
        batched = torch.cat(out, 1)
        for i, r in enumerate(rows):
            alone = model(torch.cat([r, follow[i]])[None]).logits[0, len(r) - 1 :]
            torch.testing.assert_close(batched[i], alone, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_batched_generation_equals_generating_each_prompt_alone(position):
    model = _model("sdpa", position)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42]]
    cfg = Sampling(max_new_tokens=12, temperature=0)
    batched = generate_batch(model, prompts, cfg)
    for prompt, got in zip(prompts, batched):
        alone = generate_batch(model, [prompt], cfg)[0]
        assert got.ids == alone.ids
        # and greedy decoding really is the argmax of the full forward of the row alone
        seq = torch.tensor([prompt])
        for _ in range(12):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
        assert got.ids == seq[0, len(prompt) :].tolist()


def test_positions_default_to_real_tokens_before_each_token():
    model = _model("sdpa", "learned")
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    pos = model._default_positions(torch.zeros(2, 4, dtype=torch.long), None, mask)
    assert pos.tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    cache = model.new_cache()
    model(torch.zeros(2, 4, dtype=torch.long), cache=cache, key_padding_mask=mask)
    assert cache.seen is not None and cache.seen.tolist() == [2, 4]
    assert cache.key_padding_mask is not None and cache.key_padding_mask.tolist() == mask.tolist()
    with pytest.raises(ValueError, match="key_padding_mask has shape"):
        model(torch.zeros(2, 3, dtype=torch.long), key_padding_mask=mask)


def test_full_length_mask_with_a_cache_is_accepted():
    """The older calling convention: a mask over every token so far, (B, position + T)."""
    model = _model("dense", "rope")
    idx = torch.randint(0, 64, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        full = model(idx).logits
        cache = model.new_cache()
        a = model(idx[:, :4], cache=cache, key_padding_mask=mask[:, :4]).logits
        b = model(idx[:, 4:], cache=cache, key_padding_mask=mask).logits
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=ATOL, rtol=1e-4)


# -- buffers ----------------------------------------------------------------------------------


def test_sliding_window_memory_does_not_grow_with_the_generated_length():
    window = 4
    layer = LayerCache(window=window)
    sizes, pointers = [], set()
    k = torch.randn(1, 2, 1, 8)
    ref = []
    for t in range(300):
        step = k + t
        ref.append(step)
        keys, _, _ = layer.update(step, step)
        assert torch.equal(keys, torch.cat(ref[-(window + 1) :], 2))  # kept window + new key
        sizes.append(layer.nbytes())
        pointers.add(layer.k.data_ptr())
    assert len(set(sizes)) == 1  # allocated once
    assert len(pointers) == 1  # never reallocated: a rolling buffer, compacted in place
    assert layer.capacity <= 2 * window and layer.length == window


def test_window_slack_is_bounded_for_large_windows():
    layer = LayerCache(window=4096)
    layer.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    assert layer.capacity == 4096 + LayerCache.WINDOW_SLACK


def test_long_prefill_into_a_small_window_keeps_only_the_window():
    layer = LayerCache(window=4)
    k = torch.arange(50.0).view(1, 1, 50, 1)
    keys, _, _ = layer.update(k, k)
    assert keys.shape[2] == 50  # the chunk's queries see every key they need
    assert layer.length == 4 and layer.capacity <= 8
    assert layer.keys()[0].flatten().tolist() == [46.0, 47.0, 48.0, 49.0]
    keys, _, _ = layer.update(k[:, :, :1] + 100, k[:, :, :1])
    assert keys.flatten().tolist() == [46.0, 47.0, 48.0, 49.0, 100.0]


def test_full_cache_is_preallocated_and_grows_geometrically():
    hinted = LayerCache(capacity=64)
    pointers = set()
    for _ in range(64):
        hinted.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
        pointers.add(hinted.k.data_ptr())
    assert len(pointers) == 1 and hinted.length == 64
    grown = LayerCache()
    capacities = set()
    for t in range(1000):
        grown.update(torch.full((1, 1, 1, 1), float(t)), torch.zeros(1, 1, 1, 1))
        capacities.add(grown.capacity)
    assert len(capacities) <= 8  # 16, 32, ..., 1024: doublings, not one per token
    assert grown.keys()[0].flatten().tolist() == [float(t) for t in range(1000)]


def test_generation_allocates_the_cache_once():
    model = _model("sdpa", "rope")
    calls = []
    original = LayerCache._allocate

    def spy(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    LayerCache._allocate = spy
    try:
        generate_batch(model, [[1, 2, 3]], Sampling(max_new_tokens=20, temperature=0))
    finally:
        LayerCache._allocate = original
    assert len(calls) == len(model.layers)


def test_reorder_selects_rows_in_every_layer():
    model = _model("sdpa", "rope")
    cache = model.new_cache()
    idx = torch.randint(0, 64, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, :2] = False
    model(idx, cache=cache, key_padding_mask=mask)
    k0 = cache.layers[0].keys()[0].clone()
    cache.reorder(torch.tensor([1, 1, 0]))
    assert torch.equal(cache.layers[0].keys()[0], k0[[1, 1, 0]])
    assert cache.seen is not None and cache.seen.tolist() == [3, 3, 5]
    assert isinstance(cache, KVCache) and cache.nbytes() > 0


# -- components that cannot cache --------------------------------------------------------------


class NoCacheAttention(SDPAttention):
    """Correct full-sequence attention from a plugin that declares it cannot cache."""

    def forward(self, q, k, v, **kw):
        assert q.shape[2] == k.shape[2], "a no-cache kernel was called with cached keys"
        return super().forward(q, k, v, **kw)


class NoCachePlugin:
    distribution = "llmkit-nocache"
    name = "nocache"

    @hookimpl
    def register_components(self, register):
        register("attention", "nocache", NoCacheAttention, capabilities={"kv_cache": False})


def test_a_component_without_kv_cache_still_generates_by_full_forwards():
    reg = registry_with(NoCachePlugin())
    spec = tiny_spec(attention={"name": "nocache"}, position={"name": "rope"}, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(load_spec_dict(spec, registry=reg)).eval()
    assert not model.supports_kv_cache
    cached = build_model(load_spec_dict(tiny_spec(position={"name": "rope"}, max_seq_len=16)))
    cached.load_state_dict(model.state_dict())
    assert cached.supports_kv_cache
    prompts = [[1, 2, 3, 4], [7]]
    cfg = Sampling(max_new_tokens=30, temperature=0)  # past max_seq_len: cropped context
    slow = generate_batch(model, prompts, cfg)
    assert [len(r.ids) for r in slow] == [30, 30]
    # within the context both paths agree exactly
    short = Sampling(max_new_tokens=10, temperature=0)
    assert [r.ids for r in generate_batch(model, prompts, short)] == [
        r.ids for r in generate_batch(cached.eval(), prompts, short)
    ]


def test_a_non_attention_component_can_opt_out_of_the_cache():
    class Plugin:
        distribution = "llmkit-nocache-ffn"
        name = "nocacheffn"

        @hookimpl
        def register_components(self, register):
            from llmkit.components.ffn.mlp import MLP

            register("ffn", "mixing", MLP, capabilities={"kv_cache": False})

    reg = registry_with(Plugin())
    model = build_model(load_spec_dict(tiny_spec(ffn={"name": "mixing"}), registry=reg))
    assert not model.supports_kv_cache
    assert isinstance(model.layers[0].ffn, nn.Module)
