"""Rotary position embedding (Su et al. 2021, "RoFormer") applied to queries and keys.

Pairing: ``half`` (default) is rotate-half, as in GPT-NeoX and Hugging Face LLaMA — feature
``i`` of the rotated block pairs with feature ``i + rot_dim/2``; ``interleaved`` pairs
neighbours ``(2i, 2i+1)``, as in the RoFormer paper, GPT-J and Meta's original Llama
checkpoints. Pair ``i`` turns at frequency ``i`` in both; both have the relative-position
property, and weights move from one layout to the other by permuting the q/k projection rows
within each head (interleaved feature ``2i + j`` is rotate-half feature ``i + j·rot_dim/2``,
the permutation of transformers' convert_llama_weights_to_hf).

Partial rotary (GPT-NeoX, Black et al. 2022): only the first ``rot_dim = int(head_dim ·
rotary_fraction)`` features rotate; the rest pass through untouched (and unscaled).

Context extension (``scaling``; frequencies in :mod:`.rope_scaling`, formula for formula as
transformers' ``modeling_rope_utils``):

- ``linear``: position interpolation (Chen et al. 2023): positions divided by
  ``scaling_factor``.
- ``ntk``: NTK-aware scaling (the "NTK-aware scaled RoPE" community post, as described in
  Peng et al. 2023, "YaRN"): the base becomes ``theta · factor^(rot_dim / (rot_dim − 2))``.
- ``dynamic``: dynamic NTK (the community method as implemented in transformers): the ntk base
  computed from the current length ``L``, ``theta · (factor·L/original_max_seq_len −
  (factor − 1))^(rot_dim/(rot_dim − 2))``, once ``L`` exceeds ``original_max_seq_len``.
- ``llama3``: Meta's Llama 3.1 frequency-dependent scaling: wavelengths longer than
  ``original_max_seq_len/low_freq_factor`` are divided by ``scaling_factor``, shorter than
  ``original_max_seq_len/high_freq_factor`` kept, smoothly interpolated between.
- ``yarn``: YaRN (Peng et al. 2023): NTK-by-parts interpolation between ``beta_fast`` and
  ``beta_slow`` rotations, cos and sin multiplied by an attention factor (``0.1·ln(factor) +
  1``, DeepSeek's mscale ratio, or ``attention_factor``).
- ``longrope``: LongRoPE (Ding et al. 2024; Phi-3): per-frequency divisors ``short_factor`` or
  ``long_factor``, cos and sin multiplied by ``sqrt(1 + ln(factor)/ln(original_max_seq_len))``
  or ``attention_factor``.

Stateful cases. ``dynamic`` and ``longrope`` depend on the sequence length, which llmkit takes
per call as ``L = max(positions) + 1`` (over the whole batch): with a KV cache, the largest
position in the call, +1. ``longrope`` uses ``long_factor`` for every position of a call with
``L > original_max_seq_len``, else ``short_factor`` — as transformers does.
``dynamic`` uses the base for ``L`` for every position of a call with ``L >
original_max_seq_len``, else ``theta``, computing that call's cos/sin in fp32. transformers
instead keeps the base of the longest call seen (``max_seq_len_cached``) until a call with
``L < original_max_seq_len`` resets it, so the two agree while lengths only grow (prefill,
then decoding) or drop below the original context, and differ for a call with
``original_max_seq_len ≤ L <`` an earlier call's length. Keys already in a KV cache keep the
rotation of the call that made them, in both.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from llmkit.components.position.options import RotaryOptions
from llmkit.components.position.rope_scaling import dynamic_inv_freq, frequencies
from llmkit.contracts import BuildContext, PositionalScheme


class RotaryPosition(PositionalScheme):
    """Rotary embedding on q/k (Su et al. 2021), rotate-half or interleaved pairing, partial
    rotary, and linear/NTK/dynamic NTK/Llama 3.1/YaRN/LongRoPE scaling. cos/sin (times the
    attention factor) are cached (fp64-built) for positions below max_seq_len and computed on
    the fly beyond, and per call for dynamic NTK beyond original_max_seq_len; q and k keep
    their dtype.
    """

    Options = RotaryOptions
    acts_on: ClassVar[frozenset[str]] = frozenset({"qk"})

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: nothing to split (acts before the sequence is split, or on
        the rank's heads)."""
        return {}

    def __init__(self, options: RotaryOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        head_dim = ctx.head_dim
        rot_dim = int(head_dim * options.rotary_fraction)
        if rot_dim < 2 or rot_dim % 2:
            raise ValueError(
                f"rotary dimensions must be a positive even number: head_dim {head_dim} × "
                f"rotary_fraction {options.rotary_fraction} gives rot_dim {rot_dim}"
            )
        freqs = frequencies(options, rot_dim)
        self.head_dim = head_dim
        self.rot_dim = rot_dim
        self.base = freqs.base
        self.position_scale = 1.0 / options.scaling_factor if options.scaling == "linear" else 1.0
        self.attention_factor = freqs.attention_factor
        self.interleaved = options.pairing == "interleaved"
        self.scaling = options.scaling
        self.original_max_seq_len = options.original_max_seq_len
        self._dynamic_ntk = (options.theta, options.scaling_factor)
        self._register_tables("", freqs.inv_freq, ctx.max_seq_len)
        if freqs.long_inv_freq is not None:
            self._register_tables("long_", freqs.long_inv_freq, ctx.max_seq_len)
        self._last: tuple[Tensor, int, tuple[Tensor, Tensor, Tensor, Tensor]] | None = None

    def _register_tables(self, prefix: str, inv_freq: Tensor, n: int) -> None:
        angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
        a = self.attention_factor
        self.register_buffer(f"{prefix}inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer(f"{prefix}cos_cached", (angles.cos() * a).float(), persistent=False)
        self.register_buffer(f"{prefix}sin_cached", (angles.sin() * a).float(), persistent=False)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 cos and sin (times the attention factor), (..., rot_dim/2), for integer
        positions (...). Every layer of a forward asks for the same positions tensor: the last
        answer is kept for it (its identity and version), so they are computed once a forward,
        not once a layer (inference tensors, which have no version counter, and compiled code
        skip this)."""
        cos, sin, _, _ = self._tables(positions)
        return cos, sin

    def _tables(self, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """cos, sin and the tables the rotation multiplies by, kept for the last positions
        (see :meth:`cos_sin`): for rotate-half (cos, cos) and (−sin, sin) side by side,
        (..., rot_dim), so it is x·cos2 + swap(x)·sin2; for interleaved pairs cos and sin."""
        if torch.compiler.is_compiling() or positions.is_inference():
            return self._compute_tables(positions)
        last = self._last
        if last is not None and last[0] is positions and last[1] == positions._version:
            return last[2]
        tables = self._compute_tables(positions)
        self._last = (positions, positions._version, tables)
        return tables

    def _compute_tables(self, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        cos, sin = self._cos_sin(positions)
        if self.interleaved:
            return cos, sin, cos, sin
        return cos, sin, torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def _cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self._lookup(positions, self.inv_freq, self.cos_cached, self.sin_cached)
        if self.scaling not in ("dynamic", "longrope") or positions.numel() == 0:
            return cos, sin
        # The call's length, without a host sync: one table or the other for all positions.
        assert self.original_max_seq_len is not None
        seq_len = positions.max() + 1
        if self.scaling == "longrope":
            lcos, lsin = self._lookup(
                positions, self.long_inv_freq, self.long_cos_cached, self.long_sin_cached
            )
        else:
            theta, factor = self._dynamic_ntk
            inv = dynamic_inv_freq(seq_len, theta, factor, self.original_max_seq_len, self.rot_dim)
            angles = positions.to(torch.float32)[..., None] * inv
            lcos, lsin = angles.cos(), angles.sin()
        long = seq_len > self.original_max_seq_len
        return torch.where(long, lcos, cos), torch.where(long, lsin, sin)

    def _lookup(
        self, positions: Tensor, inv_freq: Tensor, cos_cached: Tensor, sin_cached: Tensor
    ) -> tuple[Tensor, Tensor]:
        n = cos_cached.shape[0]
        idx = positions.clamp(0, n - 1)
        cos, sin = cos_cached[idx], sin_cached[idx]
        # Positions past the cache (found without a host sync): computed on the fly in fp32.
        angles = positions.to(torch.float32)[..., None] * inv_freq
        a = self.attention_factor
        inside = ((positions >= 0) & (positions < n))[..., None]
        return torch.where(inside, cos, angles.cos() * a), torch.where(
            inside, sin, angles.sin() * a
        )

    def _rotate_pairs(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        r = self.rot_dim
        if self.interleaved:
            xf = x[..., :r].float()
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            rotated = rotated.flatten(-2).to(x.dtype)
        else:  # cos, sin here are the full-width (…, r) tables of _tables
            rotated = _RotateHalf.apply(x if r == x.shape[-1] else x[..., :r], cos, sin)
        if r == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., r:]), dim=-1)

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"rotary built for head_dim {self.head_dim}, got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}"
            )
        _, _, cos, sin = self._tables(positions)
        if positions.dim() == 2:  # (B, T, ·) → (B, 1, T, ·) to broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        return self._rotate_pairs(q, cos, sin), self._rotate_pairs(k, cos, sin)

    def extra_repr(self) -> str:
        return (
            f"rot_dim={self.rot_dim}, interleaved={self.interleaved}, scaling={self.scaling}, "
            f"base={self.base:g}, position_scale={self.position_scale:g}, "
            f"attention_factor={self.attention_factor:g}"
        )


def _swap_halves(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat((x[..., h:], x[..., :h]), dim=-1)


class _RotateHalf(torch.autograd.Function):
    """Rotate-half RoPE, y = x·cos2 + swap(x)·sin2 with cos2 = (cos, cos) and sin2 =
    (−sin, sin), computed in fp32 and returned in x's dtype, with its analytic backward
    dx = g·cos2 − swap(g)·sin2 (the inverse rotation): three ops each way instead of the
    dozen autograd records for the split-and-concatenate form."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos2: Tensor, sin2: Tensor) -> Tensor:
        ctx.save_for_backward(cos2, sin2)
        xf = x.float()
        return torch.addcmul(xf * cos2, _swap_halves(xf), sin2).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cos2, sin2 = ctx.saved_tensors
        g = grad.float()
        return torch.addcmul(g * cos2, _swap_halves(g), sin2, value=-1.0).to(grad.dtype), None, None
