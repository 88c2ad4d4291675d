"""What the options of a dense feed-forward block say about it: its hidden size, its
parameters and its options as they take effect (the contract facts of
:class:`~llmkit.options.ComponentOptions`), shared by ``mlp``, ``swiglu`` and ``geglu``
and their experts in ``moe``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from llmkit.options import ffn_hidden


class HiddenWidth:
    """Mixed into the options of a block of ``matrices`` d × hidden weight matrices (an MLP
    has 2, a gated block 3), whose options have ``hidden``, ``multiplier``,
    ``multiple_of`` and ``bias`` (None: the model's): ``class Options(HiddenWidth,
    ComponentOptions)``. With biases, every matrix into the hidden size has one of that size
    and the output matrix one of size d."""

    matrices: ClassVar[int] = 2

    def hidden_size(self, d_model: int) -> int:
        """The hidden size in a model of width ``d_model``: ``hidden``, else
        ``multiplier·d_model`` rounded up to ``multiple_of``."""
        o: Any = self
        return ffn_hidden(d_model, o.hidden, o.multiplier, o.multiple_of)

    def has_bias(self, bias: bool) -> bool:
        """Whether the projections have biases in a model whose setting is ``bias``."""
        own = getattr(self, "bias", None)
        return bias if own is None else own

    def parameter_count(self, d_model: int, bias: bool) -> int:
        """``matrices·d·h`` weights, plus ``(matrices − 1)·h + d`` biases when it has them."""
        h, m = self.hidden_size(d_model), self.matrices
        return m * d_model * h + ((m - 1) * h + d_model if self.has_bias(bias) else 0)

    def effective(self, d_model: int, bias: bool) -> dict[str, Any]:
        """Every option, with ``bias`` resolved and ``hidden`` the hidden size in place of
        ``multiplier`` and ``multiple_of``."""
        o: Any = self
        out = o.model_dump(mode="json")
        out["bias"] = self.has_bias(bias)
        out["hidden"] = self.hidden_size(d_model)
        del out["multiplier"], out["multiple_of"]
        return out
