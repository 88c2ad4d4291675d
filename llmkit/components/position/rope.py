"""Rotary position embedding (Su et al. 2021, "RoFormer") applied to queries and keys.

Pairing: rotate-half, as in GPT-NeoX and Hugging Face LLaMA — feature ``i`` of the rotated
block pairs with feature ``i + rot_dim/2`` (not with its neighbour ``i+1`` as in the
RoFormer paper's interleaved layout); both give the same relative-position property, but
weights converted from one layout need their q/k projections permuted for the other.

Partial rotary (GPT-NeoX, Black et al. 2022): only the first ``rot_dim = int(head_dim ·
rotary_fraction)`` features rotate; the rest pass through untouched.

Context extension: ``linear`` is position interpolation (Chen et al. 2023: positions are
divided by ``scaling_factor``); ``ntk`` is NTK-aware scaling (the "NTK-aware scaled RoPE"
community post, as described in Peng et al. 2023, "YaRN"): the base becomes
``theta · factor^(rot_dim / (rot_dim − 2))``, stretching low frequencies while keeping the
highest one.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from llmkit.contracts import BuildContext, ComponentOptions, PositionalScheme


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
    scaling: Literal["none", "linear", "ntk"] = Field(
        "none",
        description="Context extension: none, linear (position interpolation, Chen et al. 2023) "
        "or ntk (NTK-aware base scaling).",
    )
    scaling_factor: float = Field(
        1.0, ge=1.0, description="Context extension factor for linear / ntk scaling."
    )

    @model_validator(mode="after")
    def _factor_needs_scaling(self) -> RotaryOptions:
        if self.scaling == "none" and self.scaling_factor != 1.0:
            raise ValueError(
                f"scaling_factor={self.scaling_factor} has no effect with scaling='none'; "
                "choose scaling='linear' or 'ntk'"
            )
        return self


class RotaryPosition(PositionalScheme):
    """Rotary embedding on q/k (Su et al. 2021), rotate-half pairing, partial rotary and
    linear/NTK scaling. cos/sin are cached (fp64-built) for positions below max_seq_len and
    computed on the fly beyond; q and k keep their dtype.
    """

    Options = RotaryOptions
    acts_on: ClassVar[frozenset[str]] = frozenset({"qk"})

    def __init__(self, options: RotaryOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        head_dim = ctx.head_dim
        rot_dim = int(head_dim * options.rotary_fraction)
        if rot_dim < 2 or rot_dim % 2:
            raise ValueError(
                f"rotary dimensions must be a positive even number: head_dim {head_dim} × "
                f"rotary_fraction {options.rotary_fraction} gives rot_dim {rot_dim}"
            )
        base = options.theta
        if options.scaling == "ntk":
            if rot_dim <= 2:
                raise ValueError(f"ntk scaling needs rot_dim > 2, got rot_dim {rot_dim}")
            base = options.theta * options.scaling_factor ** (rot_dim / (rot_dim - 2))
        self.head_dim = head_dim
        self.rot_dim = rot_dim
        self.base = base
        self.position_scale = 1.0 / options.scaling_factor if options.scaling == "linear" else 1.0

        inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
        angles = torch.arange(ctx.max_seq_len, dtype=torch.float64)[:, None] * (
            self.position_scale * inv_freq
        )
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("cos_cached", angles.cos().float(), persistent=False)
        self.register_buffer("sin_cached", angles.sin().float(), persistent=False)
        self._last: tuple[Tensor, int, Tensor, Tensor] | None = None

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 cos and sin, (..., rot_dim/2), for integer positions (...). Every layer of
        a forward asks for the same positions tensor: the last answer is kept for it (its
        identity and version), so they are computed once a forward, not once a layer
        (inference tensors, which have no version counter, and compiled code skip this)."""
        if positions.is_inference() or torch.compiler.is_compiling():
            return self._cos_sin(positions)
        last = self._last
        if last is not None and last[0] is positions and last[1] == positions._version:
            return last[2], last[3]
        cos, sin = self._cos_sin(positions)
        self._last = (positions, positions._version, cos, sin)
        return cos, sin

    def _cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        n = self.cos_cached.shape[0]
        idx = positions.clamp(0, n - 1)
        cos, sin = self.cos_cached[idx], self.sin_cached[idx]
        # Positions past the cache (found without a host sync): computed on the fly in fp32.
        angles = positions.to(torch.float32)[..., None] * (self.position_scale * self.inv_freq)
        inside = ((positions >= 0) & (positions < n))[..., None]
        return torch.where(inside, cos, angles.cos()), torch.where(inside, sin, angles.sin())

    def _rotate_half_pairs(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        r, h = self.rot_dim, self.rot_dim // 2
        xf = x[..., :r].float()
        x1, x2 = xf[..., :h], xf[..., h:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if r == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., r:]), dim=-1)

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"rotary built for head_dim {self.head_dim}, got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}"
            )
        cos, sin = self.cos_sin(positions)
        if positions.dim() == 2:  # (B, T, r/2) → (B, 1, T, r/2) to broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        return self._rotate_half_pairs(q, cos, sin), self._rotate_half_pairs(k, cos, sin)

    def extra_repr(self) -> str:
        return f"rot_dim={self.rot_dim}, base={self.base:g}, position_scale={self.position_scale:g}"
