"""The options of the adapters (torch-free: a spec is checked without them)."""

from __future__ import annotations

from pydantic import Field

from llmkit.options import AdapterOptions


class LoRAOptions(AdapterOptions):
    """Options of LoRA."""

    rank: int = Field(8, gt=0, le=4096, description="Rank r of the update B·A.")
    alpha: float = Field(
        16.0, gt=0, le=1e6, allow_inf_nan=False, description="Scale numerator: α/r (or α/√r)."
    )
    rank_stabilized: bool = Field(False, description="Scale by α/√r (rsLoRA) instead of α/r.")


class DoRAOptions(LoRAOptions):
    """Options of DoRA (those of LoRA)."""
