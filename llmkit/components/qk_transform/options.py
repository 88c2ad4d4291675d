"""The options of the q/k transforms (torch-free: a spec is checked without them)."""

from __future__ import annotations

from pydantic import Field

from llmkit.options import ComponentOptions


class QKRMSNormOptions(ComponentOptions):
    """Options of the per-head q/k RMSNorm."""

    eps: float = Field(1e-6, gt=0.0, description="Added to the mean square of q and k.")
    offset: float = Field(
        0.0, description="The gains are offset + weight (Gemma 3: 1, weights starting at 0)."
    )
