"""The options of the attention kernels (torch-free: a spec is checked without the kernels)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from llmkit.options import ComponentOptions


class DenseAttentionOptions(ComponentOptions):
    """Options of the dense reference kernel."""

    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on attention probabilities (training only)."
    )
    window: int | None = Field(
        None,
        ge=1,
        description="Causal sliding window: keys each query attends, counting itself "
        "(positions p−W+1 … p); unset attends every earlier key.",
    )
    softcap: float | None = Field(
        None,
        gt=0.0,
        description="Soft-cap the scaled scores to (−c, c) as c·tanh(s/c) before masking "
        "(Gemma 2's attention logit soft-capping).",
    )

    training_only: ClassVar[frozenset[str]] = frozenset({"dropout"})


class SDPAttentionOptions(ComponentOptions):
    """Options of the SDPA kernel."""

    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on attention probabilities (training only)."
    )

    training_only: ClassVar[frozenset[str]] = frozenset({"dropout"})


class SlidingWindowOptions(ComponentOptions):
    """Options of sliding-window attention."""

    window: int = Field(
        256, ge=1, description="Keys each query attends, counting itself (positions p−W+1 … p)."
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on attention probabilities (training only)."
    )

    training_only: ClassVar[frozenset[str]] = frozenset({"dropout"})
