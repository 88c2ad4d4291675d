"""The options of the positional schemes (torch-free: a spec is checked without them),
with the checks of rotary scaling options (which options each scaling type reads)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from llmkit.options import ComponentOptions

_Positive = Annotated[float, Field(gt=0.0)]


class SinusoidalOptions(ComponentOptions):
    """Options of the sinusoidal encoding."""

    base: float = Field(
        10000.0, gt=1.0, description="Wavelength base: frequencies are base^(−2i/d)."
    )


class ALiBiOptions(ComponentOptions):
    """Options of ALiBi."""

    max_bias: float = Field(
        8.0, gt=0.0, description="b in the slopes 2^(−b/n)…2^(−b) (MPT's alibi_bias_max)."
    )


class RotaryOptions(ComponentOptions):
    """Options of rotary position embedding."""

    theta: float = Field(
        10000.0, gt=1.0, description="Base of the rotation frequencies theta^(−2i/rot_dim)."
    )
    rotary_fraction: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Fraction of each head's dimensions that rotate (GPT-NeoX partial rotary); "
        "int(head_dim·fraction) must be even.",
    )
    pairing: Literal["half", "interleaved"] = Field(
        "half",
        description="Which features rotate together: half (feature i with i + rot_dim/2; "
        "GPT-NeoX, Hugging Face Llama) or interleaved (2i with 2i+1; RoFormer, GPT-J, Meta's "
        "Llama checkpoints).",
    )
    scaling: Literal["none", "linear", "ntk", "dynamic", "llama3", "yarn", "longrope"] = Field(
        "none",
        description="Context extension: none, linear (position interpolation, Chen et al. "
        "2023), ntk (NTK-aware base), dynamic (NTK base from the call's length max(positions)+1 "
        "once beyond original_max_seq_len), llama3 (Llama 3.1), yarn (Peng et al. 2023) or "
        "longrope (Ding et al. 2024).",
    )
    scaling_factor: float = Field(
        1.0,
        ge=1.0,
        description="Context extension factor (Hugging Face's factor): linear, ntk, dynamic, "
        "llama3, yarn; for longrope only the default attention factor derives from it.",
    )
    original_max_seq_len: int | None = Field(
        None,
        ge=1,
        description="Pre-training context length (Hugging Face's original_max_position_"
        "embeddings; for dynamic its max_position_embeddings). Required by dynamic, llama3, "
        "yarn and longrope: longrope switches to long_factor and dynamic rescales its base for "
        "a call whose max(positions)+1 exceeds it.",
    )
    low_freq_factor: float = Field(
        1.0,
        gt=0.0,
        description="llama3: wavelengths above original_max_seq_len/low_freq_factor are "
        "divided by scaling_factor.",
    )
    high_freq_factor: float = Field(
        4.0,
        gt=0.0,
        description="llama3: wavelengths below original_max_seq_len/high_freq_factor are kept; "
        "must exceed low_freq_factor.",
    )
    beta_fast: float = Field(
        32.0,
        gt=0.0,
        description="yarn: dimensions rotating more than beta_fast times over "
        "original_max_seq_len keep their frequency.",
    )
    beta_slow: float = Field(
        1.0,
        gt=0.0,
        description="yarn: dimensions rotating fewer than beta_slow times over "
        "original_max_seq_len are interpolated (frequency / scaling_factor).",
    )
    truncate: bool = Field(
        True, description="yarn: round the correction range outward to whole dimensions."
    )
    mscale: float | None = Field(
        None,
        gt=0.0,
        description="yarn (DeepSeek): with mscale_all_dim, attention factor "
        "(0.1·mscale·ln s + 1)/(0.1·mscale_all_dim·ln s + 1) instead of 0.1·ln s + 1.",
    )
    mscale_all_dim: float | None = Field(
        None, gt=0.0, description="yarn (DeepSeek): the denominator's mscale; see mscale."
    )
    attention_factor: float | None = Field(
        None,
        gt=0.0,
        description="yarn, longrope: factor cos and sin are multiplied by, overriding the "
        "one derived from scaling_factor.",
    )
    short_factor: tuple[_Positive, ...] | None = Field(
        None,
        min_length=1,
        description="longrope: rot_dim/2 frequency divisors for calls whose max(positions)+1 "
        "is at most original_max_seq_len.",
    )
    long_factor: tuple[_Positive, ...] | None = Field(
        None,
        min_length=1,
        description="longrope: rot_dim/2 frequency divisors for calls whose max(positions)+1 "
        "exceeds original_max_seq_len.",
    )

    @model_validator(mode="after")
    def _factor_needs_scaling(self) -> RotaryOptions:
        check_scaling(self)
        return self


#: The scaling options each scaling type reads; any other one set away from its default is
#: rejected (it would have no effect).
USES: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "linear": frozenset({"scaling_factor"}),
    "ntk": frozenset({"scaling_factor"}),
    "dynamic": frozenset({"scaling_factor", "original_max_seq_len"}),
    "llama3": frozenset(
        {"scaling_factor", "original_max_seq_len", "low_freq_factor", "high_freq_factor"}
    ),
    "yarn": frozenset(
        {
            "scaling_factor",
            "original_max_seq_len",
            "beta_fast",
            "beta_slow",
            "truncate",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
        }
    ),
    "longrope": frozenset(
        {
            "scaling_factor",
            "original_max_seq_len",
            "attention_factor",
            "short_factor",
            "long_factor",
        }
    ),
}
SCALING_OPTIONS = frozenset().union(*USES.values())


def check_scaling(o: RotaryOptions) -> None:
    """Raise a one-line ValueError for a combination of scaling options that is incomplete,
    inconsistent, or sets an option the chosen scaling ignores."""
    fields = type(o).model_fields
    for name in sorted(SCALING_OPTIONS - USES[o.scaling]):
        value = getattr(o, name)
        if value != fields[name].default:
            users = ", ".join(repr(s) for s, used in USES.items() if name in used)
            raise ValueError(
                f"{name}={value!r} has no effect with scaling={o.scaling!r}; "
                f"it applies to scaling {users}"
            )
    if "original_max_seq_len" in USES[o.scaling] and o.original_max_seq_len is None:
        raise ValueError(
            f"scaling={o.scaling!r} needs original_max_seq_len (the pre-training context "
            "length, Hugging Face's original_max_position_embeddings)"
        )
    if o.scaling == "llama3" and o.high_freq_factor <= o.low_freq_factor:
        raise ValueError(
            f"high_freq_factor ({o.high_freq_factor}) must exceed low_freq_factor "
            f"({o.low_freq_factor})"
        )
    if o.scaling == "yarn":
        if o.beta_fast < o.beta_slow:
            raise ValueError(f"beta_fast ({o.beta_fast}) must be ≥ beta_slow ({o.beta_slow})")
        if (o.mscale is None) != (o.mscale_all_dim is None):
            raise ValueError(
                "mscale and mscale_all_dim go together: yarn uses them for its attention "
                "factor only when both are set"
            )
        if o.mscale is not None and o.attention_factor is not None:
            raise ValueError(
                "mscale and mscale_all_dim have no effect when attention_factor is set; "
                "drop one or the other"
            )
    if o.scaling == "longrope":
        if o.short_factor is None or o.long_factor is None:
            raise ValueError(
                "scaling='longrope' needs short_factor and long_factor (rot_dim/2 numbers each)"
            )
        if len(o.short_factor) != len(o.long_factor):
            raise ValueError(
                f"short_factor has {len(o.short_factor)} numbers but long_factor has "
                f"{len(o.long_factor)}; each needs rot_dim/2"
            )
        if o.attention_factor is not None and o.scaling_factor != 1.0:
            raise ValueError(
                f"scaling_factor={o.scaling_factor} has no effect with scaling='longrope' and "
                "attention_factor set: longrope uses it only to derive the attention factor"
            )
