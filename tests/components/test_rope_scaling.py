"""Rotary scaling types (dynamic NTK, Llama 3.1, YaRN, LongRoPE) and interleaved pairing,
checked against transformers (the rope_parameters mapping:
tests/interop/test_hf_rope_parameters.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor

from llmkit.components.position.rope import RotaryOptions, RotaryPosition
from llmkit.components.position.rope_scaling import dynamic_inv_freq
from llmkit.contracts import BuildContext

HEAD_DIM = 16  # transformers configs below: hidden_size 64, 4 heads


def build(head_dim: int = HEAD_DIM, max_seq_len: int = 48, **opts: Any) -> RotaryPosition:
    ctx = BuildContext(
        d_model=4 * head_dim,
        n_heads=4,
        n_kv_heads=4,
        head_dim=head_dim,
        max_seq_len=max_seq_len,
        n_layers=1,
    )
    return RotaryPosition(RotaryOptions(**opts), ctx)


def without_name(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k != "name"}


SHORT = [1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
LONG = [1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]

# (id, transformers rope_parameters, max_position_embeddings, the llmkit options they map to)
CASES: list[tuple[str, dict[str, Any], int, dict[str, Any]]] = [
    (
        "linear",
        {"rope_type": "linear", "factor": 2.0},
        32,
        {"scaling": "linear", "scaling_factor": 2.0},
    ),
    (
        "dynamic",
        {"rope_type": "dynamic", "factor": 2.0},
        16,
        {"scaling": "dynamic", "scaling_factor": 2.0, "original_max_seq_len": 16},
    ),
    (
        "llama3",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        512,
        {
            "scaling": "llama3",
            "scaling_factor": 8.0,
            "original_max_seq_len": 64,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ),
    (
        "yarn",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        1024,
        {"scaling": "yarn", "scaling_factor": 4.0, "original_max_seq_len": 256},
    ),
    (
        "yarn-betas-no-truncate",
        {
            "rope_type": "yarn",
            "rope_theta": 100.0,
            "factor": 3.0,
            "beta_fast": 2.0,
            "beta_slow": 0.5,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
        48,
        {
            "theta": 100.0,
            "scaling": "yarn",
            "scaling_factor": 3.0,
            "original_max_seq_len": 16,
            "beta_fast": 2.0,
            "beta_slow": 0.5,
            "truncate": False,
        },
    ),
    (
        "yarn-deepseek-mscale",
        {
            "rope_type": "yarn",
            "rope_theta": 100.0,
            "factor": 4.0,
            "beta_fast": 2.0,
            "beta_slow": 0.5,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 16,
        },
        64,
        {
            "theta": 100.0,
            "scaling": "yarn",
            "scaling_factor": 4.0,
            "original_max_seq_len": 16,
            "beta_fast": 2.0,
            "beta_slow": 0.5,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    ),
    (
        "yarn-attention-factor",
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "attention_factor": 1.3,
            "original_max_position_embeddings": 16,
        },
        32,
        {
            "scaling": "yarn",
            "scaling_factor": 2.0,
            "original_max_seq_len": 16,
            "attention_factor": 1.3,
        },
    ),
    (
        "longrope",  # Phi-3: no factor, so factor = max_position_embeddings / original
        {
            "rope_type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": 16,
        },
        64,
        {
            "scaling": "longrope",
            "scaling_factor": 4.0,
            "original_max_seq_len": 16,
            "short_factor": SHORT,
            "long_factor": LONG,
        },
    ),
    (
        "longrope-partial-attention-factor",
        {
            "rope_type": "longrope",
            "rope_theta": 500.0,
            "partial_rotary_factor": 0.5,
            "short_factor": SHORT[:4],
            "long_factor": LONG[:4],
            "attention_factor": 1.1,
            "original_max_position_embeddings": 16,
        },
        64,
        {
            "theta": 500.0,
            "rotary_fraction": 0.5,
            "scaling": "longrope",
            "original_max_seq_len": 16,
            "short_factor": SHORT[:4],
            "long_factor": LONG[:4],
            "attention_factor": 1.1,
        },
    ),
]
IDS = [c[0] for c in CASES]


def hf_config(rope_parameters: dict[str, Any], max_position_embeddings: int):
    transformers = pytest.importorskip("transformers")
    params = {"rope_theta": 10000.0, **rope_parameters}
    params = {k: list(v) if isinstance(v, list) else v for k, v in params.items()}
    return transformers.LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=params,
    )


def hf_init(config, seq_len: int | None = None) -> tuple[Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, None, seq_len=seq_len)


def rel_close(got: Tensor, want: Tensor, rtol: float = 1e-6) -> None:
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=0.0)


# -- frequencies and attention factor against transformers' ROPE_INIT_FUNCTIONS --------------


@pytest.mark.parametrize(("case", "hf", "max_pos", "options"), CASES, ids=IDS)
def test_inv_freq_and_attention_factor_match_transformers(case, hf, max_pos, options):
    config = hf_config(hf, max_pos)
    want, want_attn = hf_init(config)
    r = build(**options)
    rel_close(r.inv_freq, want)
    assert r.attention_factor == pytest.approx(want_attn, rel=1e-6)
    if options["scaling"] == "yarn":  # the case is not the plain frequencies in disguise
        assert not torch.allclose(r.inv_freq, build(theta=r.base).inv_freq)
    if options["scaling"] == "longrope":
        long, _ = hf_init(config, seq_len=options["original_max_seq_len"] + 1)
        rel_close(r.long_inv_freq, long)
    if options["scaling"] == "dynamic":
        for n in (17, 40, 1000):
            want_n, _ = hf_init(config, seq_len=n)
            rel_close(dynamic_inv_freq(torch.tensor(n), 10000.0, 2.0, 16, HEAD_DIM), want_n)


def test_llama3_bands():
    """The llama3 case has all three bands: kept, smoothed, divided by the factor."""
    opts = CASES[IDS.index("llama3")][3]
    ratio = build(**opts).inv_freq.double() / build().inv_freq.double()
    assert ratio[0] == 1.0
    assert ((ratio > 1 / 8 + 1e-9) & (ratio < 1 - 1e-9)).any()
    assert ratio[-1] == pytest.approx(1 / 8)


# -- q/k end to end against LlamaRotaryEmbedding + apply_rotary_pos_emb ------------------------


def hf_rotate(emb, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ids = positions if positions.dim() == 2 else positions[None]
    cos, sin = emb(q, ids)
    return apply_rotary_pos_emb(q, k, cos, sin)


def check_against(r: RotaryPosition, emb, positions: Tensor, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    batch = positions.shape[0] if positions.dim() == 2 else 1
    q = torch.randn(batch, 4, positions.shape[-1], HEAD_DIM, generator=g)
    k = torch.randn(batch, 4, positions.shape[-1], HEAD_DIM, generator=g)
    got = r.rotate(q, k, positions)
    want = hf_rotate(emb, q, k, positions)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


E2E = [c for c in CASES if "partial" not in c[0]]


@pytest.mark.parametrize(("case", "hf", "max_pos", "options"), E2E, ids=[c[0] for c in E2E])
def test_rotated_qk_match_transformers_llama(case, hf, max_pos, options):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    emb = LlamaRotaryEmbedding(hf_config(hf, max_pos))
    r = build(max_seq_len=48, **options)  # positions ≥ 48: computed on the fly
    old = options.get("original_max_seq_len", 16)
    # Lengths max(positions)+1 grow, as transformers' dynamic NTK keeps the longest one's base:
    # short, decoding steps up to and across the original context, a (B, T) batch, long, a
    # decoding step beyond, then short again (transformers resets below the original context).
    calls = [
        torch.arange(10),
        torch.arange(12),
        torch.tensor([old - 1]),
        torch.arange(old - 4, old),
        torch.tensor([old]),
        torch.stack([torch.arange(20), torch.arange(20) + old - 11]),
        torch.arange(2 * old + 8),
        torch.tensor([2 * old + 8]),
        torch.arange(10),
    ]
    for i, positions in enumerate(calls):
        check_against(r, emb, positions, seed=i)


def test_dynamic_uses_each_calls_own_length():
    """transformers keeps the base of the longest call seen; llmkit recomputes per call: after
    a call of 41 positions, one of 30 equals a fresh transformers module."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    _, hf, max_pos, options = CASES[IDS.index("dynamic")]
    r = build(**options)
    seen = LlamaRotaryEmbedding(hf_config(hf, max_pos))
    check_against(r, seen, torch.arange(41))
    check_against(r, LlamaRotaryEmbedding(hf_config(hf, max_pos)), torch.arange(30))
    with pytest.raises(AssertionError):
        check_against(r, seen, torch.arange(30))


def test_longrope_partial_matches_phi3():
    """Partial rotary with longrope (Phi-4-mini's layout): the attention factor scales the
    rotated part only."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    _, hf, max_pos, options = CASES[IDS.index("longrope-partial-attention-factor")]
    config = transformers.Phi3Config(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_pos,
        original_max_position_embeddings=16,  # Phi-3 reads it here, over rope_parameters
        rope_parameters=dict(hf),
    )
    emb = Phi3RotaryEmbedding(config)
    r = build(**options)
    g = torch.Generator().manual_seed(3)
    for positions in (torch.arange(10), torch.arange(40)):
        q = torch.randn(1, 4, len(positions), HEAD_DIM, generator=g)
        k = torch.randn(1, 4, len(positions), HEAD_DIM, generator=g)
        cos, sin = emb(q, positions[None])
        for a, b in zip(r.rotate(q, k, positions), apply_rotary_pos_emb(q, k, cos, sin)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(r.rotate(q, k, positions)[0][..., 8:], q[..., 8:])


def test_stateful_scalings_switch_per_call_and_memoize():
    _, _, _, options = CASES[IDS.index("longrope")]
    r = build(**options)
    q = torch.randn(1, 1, 1, HEAD_DIM)
    p = torch.tensor([3])
    short = r.rotate(q, q, p)[0]
    alone_long = r.rotate(q, q, torch.tensor([3, 16]))[0][:, :, :1]  # length 17 > 16: long
    assert not torch.allclose(short, alone_long)
    positions = torch.arange(20)
    assert r.cos_sin(positions)[0] is r.cos_sin(positions)[0]
    assert r.state_dict() == {}
    empty = r.rotate(torch.randn(1, 1, 0, HEAD_DIM), torch.randn(1, 1, 0, HEAD_DIM), p[:0])
    assert empty[0].shape == (1, 1, 0, HEAD_DIM)


# -- interleaved pairing ----------------------------------------------------------------------


def meta_to_hf_permute(w: Tensor, n_heads: int) -> Tensor:
    """transformers' convert_llama_weights_to_hf ``permute`` of q/k projection rows."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


@pytest.mark.parametrize(("head_dim", "fraction"), [(8, 1.0), (16, 0.5)])
def test_interleaved_equals_rotate_half_on_permuted_heads(head_dim, fraction):
    n_heads, c, t = 2, 12, 7
    rot = int(head_dim * fraction)
    g = torch.Generator().manual_seed(0)
    w_meta = torch.randn(n_heads * rot, c, generator=g)  # the rotating rows of each head
    w_hf = meta_to_hf_permute(w_meta, n_heads)
    x = torch.randn(1, t, c, generator=g)
    tail = torch.randn(1, n_heads, t, head_dim - rot, generator=g)

    def heads(w: Tensor) -> Tensor:
        return torch.cat(((x @ w.T).view(1, t, n_heads, rot).transpose(1, 2), tail), dim=-1)

    q_meta, q_hf = heads(w_meta), heads(w_hf)
    perm = torch.cat(
        (torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, head_dim))
    )
    assert torch.equal(q_hf, q_meta[..., perm])

    positions = torch.arange(t) * 3
    inter = build(head_dim, rotary_fraction=fraction, pairing="interleaved", theta=100.0)
    half = build(head_dim, rotary_fraction=fraction, theta=100.0)
    qi, ki = inter.rotate(q_meta, q_meta.flip(2), positions)
    qh, kh = half.rotate(q_hf, q_hf.flip(2), positions)
    torch.testing.assert_close(qh, qi[..., perm], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qi @ ki.transpose(-1, -2), qh @ kh.transpose(-1, -2))
    assert torch.equal(qi[..., rot:], tail)
    assert not torch.allclose(qi, half.rotate(q_meta, q_meta, positions)[0])


def test_interleaved_is_complex_multiplication_and_relative():
    r = build(8, pairing="interleaved", theta=50.0)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    positions = torch.tensor([0, 1, 2, 5, 9, 30])
    qr, kr = r.rotate(q, k, positions)
    # Su et al.: pair i is the complex number x_2i + i·x_2i+1, multiplied by e^(i·p·θ_i).
    inv = 50.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    turn = torch.polar(torch.ones(6, 4, dtype=torch.float64), positions.double()[:, None] * inv)
    want = torch.view_as_real(torch.view_as_complex(q.double().reshape(2, 2, 6, 4, 2)) * turn)
    torch.testing.assert_close(qr.double(), want.flatten(-2), rtol=1e-5, atol=1e-5)
    # q·k depends only on the position difference.
    sq, sk = r.rotate(q, k, positions + 17)
    torch.testing.assert_close(sq @ sk.transpose(-1, -2), qr @ kr.transpose(-1, -2))
    wq, wk = r.rotate(q, k, positions * 2)
    assert not torch.allclose(wq @ wk.transpose(-1, -2), qr @ kr.transpose(-1, -2), atol=1e-3)


def test_new_variants_conform():
    from llmkit.registry import get_registry
    from llmkit.testing import check_component

    record = get_registry().get("position", "rope")
    for options in (
        {"pairing": "interleaved"},
        {"pairing": "interleaved", "rotary_fraction": 0.5},
        {"scaling": "llama3", "scaling_factor": 8.0, "original_max_seq_len": 16},
        {"scaling": "yarn", "scaling_factor": 4.0, "original_max_seq_len": 16},
        {"scaling": "dynamic", "scaling_factor": 2.0, "original_max_seq_len": 64},
        {
            "scaling": "longrope",
            "original_max_seq_len": 64,
            "short_factor": [1, 2, 3, 4],
            "long_factor": [2, 3, 4, 5],
            "scaling_factor": 4.0,
        },
    ):
        check_component(record, options)


# -- validation ---------------------------------------------------------------------------------


LLAMA3 = {"scaling": "llama3", "scaling_factor": 8.0, "original_max_seq_len": 16}
YARN = {"scaling": "yarn", "scaling_factor": 4.0, "original_max_seq_len": 16}
LONGROPE = {
    "scaling": "longrope",
    "original_max_seq_len": 16,
    "short_factor": [1.0, 2.0],
    "long_factor": [2.0, 3.0],
}
BAD: list[tuple[dict[str, Any], str]] = [
    ({"scaling": "llama3", "scaling_factor": 8.0}, "scaling='llama3' needs original_max_seq_len"),
    ({"scaling": "yarn"}, "scaling='yarn' needs original_max_seq_len"),
    ({"scaling": "dynamic", "scaling_factor": 2.0}, "'dynamic' needs original_max_seq_len"),
    (
        {"scaling": "linear", "scaling_factor": 2.0, "original_max_seq_len": 16},
        "original_max_seq_len=16 has no effect with scaling='linear'",
    ),
    (
        {"beta_fast": 16.0},
        "beta_fast=16.0 has no effect with scaling='none'; it applies to .*'yarn'",
    ),
    ({**YARN, "low_freq_factor": 2.0}, "low_freq_factor=2.0 has no effect with scaling='yarn'"),
    (
        {**LLAMA3, "attention_factor": 1.2},
        "attention_factor=1.2 has no effect with scaling='llama3'",
    ),
    ({**LLAMA3, "short_factor": [1.0]}, "short_factor=.* has no effect with scaling='llama3'"),
    ({"scaling": "ntk", "scaling_factor": 2.0, "truncate": False}, "truncate=False has no effect"),
    ({"scaling": "longrope", "original_max_seq_len": 16}, "needs short_factor and long_factor"),
    (
        {**LONGROPE, "long_factor": [1.0, 2.0, 3.0]},
        "short_factor has 2 numbers but long_factor has 3",
    ),
    (
        {**LONGROPE, "scaling_factor": 4.0, "attention_factor": 1.2},
        "scaling_factor=4.0 has no effect with scaling='longrope' and attention_factor set",
    ),
    ({**YARN, "mscale": 0.7}, "mscale and mscale_all_dim go together"),
    (
        {**YARN, "mscale": 0.7, "mscale_all_dim": 1.0, "attention_factor": 1.2},
        "no effect when attention_factor is set",
    ),
    (
        {**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 4.0},
        r"high_freq_factor \(4.0\) must exceed low_freq_factor \(4.0\)",
    ),
    (
        {**YARN, "beta_fast": 1.0, "beta_slow": 2.0},
        r"beta_fast \(1.0\) must be ≥ beta_slow \(2.0\)",
    ),
    ({**LONGROPE, "short_factor": [1.0, -2.0]}, "greater than 0"),
    ({**LONGROPE, "short_factor": []}, "at least 1 item"),
    ({"pairing": "interleave"}, "'half' or 'interleaved'"),
    ({"scaling": "ntk_dynamic"}, "'longrope'"),
    ({**YARN, "original_max_seq_len": 0}, "greater than or equal to 1"),
]


@pytest.mark.parametrize(("options", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_bad_combinations_are_one_line_validation_errors(options, message):
    with pytest.raises(ValidationError, match=message) as info:
        RotaryOptions(**options)
    (error,) = info.value.errors()
    assert "\n" not in error["msg"]


def test_good_combinations_validate():
    for options in (LLAMA3, YARN, LONGROPE, {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}):
        RotaryOptions(**options)
    assert RotaryOptions(**LONGROPE).short_factor == (1.0, 2.0)


def test_build_time_errors_name_rot_dim():
    with pytest.raises(ValueError, match=r"2 numbers; rot_dim 16 needs rot_dim/2 = 8"):
        build(**LONGROPE)
    with pytest.raises(ValueError, match="dynamic scaling needs rot_dim > 2"):
        build(2, scaling="dynamic", original_max_seq_len=8)
