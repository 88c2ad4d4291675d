"""Every combination of built-in attention × position × ffn × norm builds a tiny model that
trains (forward, backward) and decodes through the KV cache exactly as the full forward, or
is refused at validation with a message naming both parts (DESIGN: "Incompatible parts fail
at validation, not mid-training")."""

from __future__ import annotations

import itertools

import pytest

from llmkit.errors import SpecError
from llmkit.registry import get_registry
from llmkit.testing import check_model_combination

pytestmark = pytest.mark.usefixtures("one_thread")


#: Options that make built-ins matter at this size: a window smaller than the sequence (16).
OPTIONS = {"sliding_window": {"window": 5}}
#: The tiny model of every combination: d_model 32, 2 layers, 4 heads, 2 kv heads, vocab 64.
MODEL = {
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "vocab_size": 64,
    "max_seq_len": 16,
}


def builtin(kind: str) -> list[str]:
    return [c.name for c in get_registry().list(kind) if c.provider == "llmkit"]


def ref(name: str) -> dict:
    return {"name": name, **OPTIONS.get(name, {})}


def expected_refusal(attention: str, position: str) -> str | None:
    """Why the registry's capabilities (registry.toml) say the spec must be refused, if so:
    "position" (the attention lacks a site the position acts on) or "gqa"."""
    reg = get_registry()
    att, pos = reg.get("attention", attention), reg.get("position", position)
    supported = set(att.capabilities.get("positions", ["embedding", "qk", "score_bias"]))
    if not set(pos.capabilities.get("acts_on", [])) <= supported:
        return "position"
    if att.capabilities.get("gqa", True) is False and MODEL["n_kv_heads"] != MODEL["n_heads"]:
        return "gqa"
    return None


COMBINATIONS = list(
    itertools.product(builtin("attention"), builtin("position"), builtin("ffn"), builtin("norm"))
)


def test_every_builtin_is_combined():
    for kind in ("attention", "position", "ffn", "norm"):
        assert builtin(kind), kind
    assert len(COMBINATIONS) >= 3 * 5 * 3 * 2


@pytest.mark.parametrize(
    ("attention", "position", "ffn", "norm"), COMBINATIONS, ids=["-".join(c) for c in COMBINATIONS]
)
def test_combination_trains_and_decodes_or_is_refused(attention, position, ffn, norm):
    refuse = expected_refusal(attention, position)
    try:
        check_model_combination(ref(attention), position, ffn, norm, model=MODEL)
    except SpecError as exc:
        message = str(exc)
        assert refuse, f"refused although the capabilities allow it: {message}"
        assert f"{attention!r}" in message, message
        assert f"{position!r}" in message if refuse == "position" else "n_kv_heads" in message
        return
    assert not refuse, f"built although the capabilities refuse it ({refuse})"


@pytest.mark.parametrize("final_norm", [True, False])
def test_post_norm_placement(final_norm):
    model = check_model_combination(
        ref("sliding_window"),
        "alibi",
        "swiglu",
        "rmsnorm",
        model={**MODEL, "norm_placement": "post", "final_norm": final_norm},
    )
    assert model.layers[0].pre_norm is False


def test_per_layer_overrides_mix_kernels_and_positions():
    """Layer 1 swaps in dense attention with rotary q/k on top of learned embeddings."""
    model = check_model_combination(
        ref("sliding_window"),
        "learned",
        "mlp",
        "layernorm",
        model={
            **MODEL,
            "overrides": [
                {"layers": [1], "attention": {"name": "dense"}, "position": {"name": "rope"}}
            ],
        },
    )
    kernels = [type(block.attn.kernel).__name__ for block in model.layers]
    assert kernels[0] != kernels[1]
