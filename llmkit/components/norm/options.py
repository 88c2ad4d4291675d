"""The options of the normalization layers (torch-free: a spec is checked without them)."""

from __future__ import annotations

from pydantic import Field

from llmkit.options import ComponentOptions


class LayerNormOptions(ComponentOptions):
    """Options of LayerNorm."""

    eps: float = Field(1e-5, gt=0.0, description="Added to the variance for numerical stability.")
    bias: bool | None = Field(
        None, description="Learn an additive bias; unset follows the model's bias setting."
    )


class RMSNormOptions(ComponentOptions):
    """Options of RMSNorm."""

    eps: float = Field(
        1e-6, gt=0.0, description="Added to the mean square for numerical stability."
    )
    offset: float = Field(
        0.0,
        description="The gain is offset + weight, weight starting at 1 − offset; Gemma's "
        "(1 + w) is offset 1 (weights then stored as w, starting at 0).",
    )
