"""The options of the residual blocks (torch-free: a spec is checked without them)."""

from __future__ import annotations

from pydantic import Field

from llmkit.options import ComponentOptions


class ParallelOptions(ComponentOptions):
    """Options of the parallel block."""

    shared_norm: bool = Field(
        True,
        description="One norm feeds both attention and ffn (GPT-J, Phi, PaLM); false: a "
        "second norm for the ffn (GPT-NeoX).",
    )


class SandwichOptions(ComponentOptions):
    """Options of the sandwich block."""

    input_norms: bool = Field(
        True,
        description="Normalize each sublayer's input as well as its output (Gemma 2); false "
        "normalizes the output only (OLMo 2).",
    )
