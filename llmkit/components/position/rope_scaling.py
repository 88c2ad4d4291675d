"""Rotary frequencies of the context-extension methods (their option checks are torch-free, in
:mod:`llmkit.components.position.options`; the mapping to and from transformers'
``rope_parameters`` is :mod:`llmkit.interop.rotary`).

Each frequency function follows the matching one of transformers'
``modeling_rope_utils`` (``_compute_linear_scaling_rope_parameters``,
``_compute_dynamic_ntk_parameters``, ``_compute_llama3_parameters``,
``_compute_yarn_parameters``, ``_compute_longrope_parameters``) formula for formula, in
float64 where transformers works in float32 (the results agree to float32 rounding). The one
exception is dynamic NTK's per-call frequencies, which depend on a tensor (the largest
position in the call) and are computed in float32 on its device, as transformers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Re-exported: the option checks moved beside the options.
from llmkit.components.position.options import SCALING_OPTIONS as SCALING_OPTIONS
from llmkit.components.position.options import USES as USES
from llmkit.components.position.options import RotaryOptions
from llmkit.components.position.options import check_scaling as check_scaling

# -- frequencies ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frequencies:
    """What the rotary module builds from: float64 inverse frequencies, (rot_dim/2,), with the
    scaling applied (for longrope: the short ones; for dynamic: the unscaled ones, used up to
    ``original_max_seq_len``), the factor cos and sin are multiplied by, the base theta the
    frequencies come from, and longrope's long inverse frequencies."""

    inv_freq: Tensor
    attention_factor: float = 1.0
    base: float = 10000.0
    long_inv_freq: Tensor | None = None


def default_inv_freq(base: float, rot_dim: int) -> Tensor:
    """``base^(−2i/rot_dim)``, i < rot_dim/2, in float64."""
    return 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)


def llama3_inv_freq(
    inv_freq: Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, old_len: int
) -> Tensor:
    """Llama 3.1: wavelengths above ``old_len/low_freq_factor`` are divided by ``factor``,
    those below ``old_len/high_freq_factor`` kept, those between interpolated smoothly."""
    low_wavelen, high_wavelen = old_len / low_freq_factor, old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(
    base: float,
    rot_dim: int,
    factor: float,
    old_len: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool,
) -> Tensor:
    """YaRN's "NTK-by-parts": dimensions turning more than ``beta_fast`` times over
    ``old_len`` positions extrapolate (keep their frequency), those turning fewer than
    ``beta_slow`` times interpolate (frequency / factor), with a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return rot_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoids dividing by zero
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = default_inv_freq(base, rot_dim)
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


def yarn_attention_factor(
    factor: float, mscale: float | None = None, mscale_all_dim: float | None = None
) -> float:
    """YaRN's cos/sin factor: ``0.1·ln(factor) + 1``, or DeepSeek's ratio
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


def longrope_attention_factor(factor: float, old_len: int) -> float:
    """LongRoPE's (Phi-3's) cos/sin factor: ``sqrt(1 + ln(factor) / ln(old_len))``."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def frequencies(o: RotaryOptions, rot_dim: int) -> Frequencies:
    """The frequencies of options ``o`` for ``rot_dim`` rotating features."""
    theta, factor, old_len = o.theta, o.scaling_factor, o.original_max_seq_len
    if o.scaling in ("ntk", "dynamic") and rot_dim <= 2:
        raise ValueError(f"{o.scaling} scaling needs rot_dim > 2, got rot_dim {rot_dim}")
    if o.scaling == "ntk":
        base = theta * factor ** (rot_dim / (rot_dim - 2))
        return Frequencies(default_inv_freq(base, rot_dim), base=base)
    plain = default_inv_freq(theta, rot_dim)
    if o.scaling == "linear":
        return Frequencies(plain / factor, base=theta)
    if o.scaling == "llama3":
        assert old_len is not None
        inv = llama3_inv_freq(plain, factor, o.low_freq_factor, o.high_freq_factor, old_len)
        return Frequencies(inv, base=theta)
    if o.scaling == "yarn":
        assert old_len is not None
        inv = yarn_inv_freq(theta, rot_dim, factor, old_len, o.beta_fast, o.beta_slow, o.truncate)
        attn = o.attention_factor
        if attn is None:
            attn = yarn_attention_factor(factor, o.mscale, o.mscale_all_dim)
        return Frequencies(inv, attn, theta)
    if o.scaling == "longrope":
        assert old_len is not None and o.short_factor is not None and o.long_factor is not None
        if len(o.short_factor) != rot_dim // 2:
            raise ValueError(
                f"longrope short_factor and long_factor have {len(o.short_factor)} numbers; "
                f"rot_dim {rot_dim} needs rot_dim/2 = {rot_dim // 2}"
            )
        attn = o.attention_factor
        if attn is None:
            attn = longrope_attention_factor(factor, old_len)
        short = plain / torch.tensor(o.short_factor, dtype=torch.float64)
        long = plain / torch.tensor(o.long_factor, dtype=torch.float64)
        return Frequencies(short, attn, theta, long)
    return Frequencies(plain, base=theta)  # none, and dynamic up to original_max_seq_len


def dynamic_inv_freq(
    seq_len: Tensor, theta: float, factor: float, old_len: int, rot_dim: int
) -> Tensor:
    """Dynamic NTK inverse frequencies, float32 on ``seq_len``'s device, for a sequence of
    ``seq_len`` (a 0-dim tensor, no host sync) positions: the base becomes
    ``theta·(factor·L/old_len − (factor − 1))^(rot_dim/(rot_dim − 2))``, L = max(seq_len,
    old_len), which is theta up to ``old_len``."""
    length = seq_len.clamp(min=old_len).to(torch.float32)
    base = theta * ((factor * length / old_len) - (factor - 1)) ** (rot_dim / (rot_dim - 2))
    exponent = torch.arange(0, rot_dim, 2, device=seq_len.device).float() / rot_dim
    return 1.0 / base**exponent
