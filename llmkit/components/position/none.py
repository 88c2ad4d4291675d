"""No positional information (NoPE): causal masking alone orders tokens.

Kazemnejad et al. 2023, "The Impact of Positional Encoding on Length Generalization in
Transformers".
"""

from __future__ import annotations

from typing import Any, ClassVar

from llmkit.contracts import BuildContext, NoOptions, PositionalScheme


class NoPosition(PositionalScheme):
    """Adds nothing anywhere (NoPE, Kazemnejad et al. 2023)."""

    Options = NoOptions
    acts_on: ClassVar[frozenset[str]] = frozenset()

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: nothing to split (acts before the sequence is split, or on
        the rank's heads)."""
        return {}

    def __init__(self, options: NoOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
