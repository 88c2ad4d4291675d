"""A run's perplexity against its quantized copy: weight bytes, loss and perplexity side by
side (``llmkit eval --quantize``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from llmkit.errors import LlmkitError
from llmkit.evaluation.perplexity import EvalResult


@dataclass
class QuantizedComparison:
    """The same evaluation of a model (``base``) and of its ``method``-quantized copy."""

    method: str
    dtype: str  # the base model's parameter dtype
    base: EvalResult
    quantized: EvalResult
    base_bytes: int
    quantized_bytes: int
    backend: str
    linear_layers: int
    #: bf16 layers packed for oneDNN keep their weights twice (plain and packed).
    packed_twice: bool

    @property
    def shrink(self) -> float:
        return self.base_bytes / max(self.quantized_bytes, 1)

    @property
    def loss_change(self) -> float:
        return self.quantized.loss - self.base.loss

    @property
    def perplexity_change(self) -> float:
        """Relative change of the perplexity, in percent."""
        return 100 * (self.quantized.ppl / self.base.ppl - 1)

    def as_dict(self) -> dict[str, Any]:
        """The report's additions: ``weight_bytes`` and the quantized results under ``method``."""
        return {
            "weight_bytes": self.base_bytes,
            self.method: {
                **self.quantized.as_dict(),
                "weight_bytes": self.quantized_bytes,
                "backend": self.backend,
                "linear_layers": self.linear_layers,
            },
        }


def compare_quantized(
    model: nn.Module, base: EvalResult, evaluate: Callable[[nn.Module], EvalResult], method: str
) -> QuantizedComparison:
    """Quantize ``model`` with ``method`` and run ``evaluate`` (the evaluation that gave
    ``base``) on the copy."""
    from llmkit.inference.quantize import BF16Linear, quantize_model, weight_bytes

    try:
        qmodel = quantize_model(model, method)
    except ValueError as exc:
        raise LlmkitError(str(exc)) from exc
    qres = evaluate(qmodel)
    info = qmodel.quantization
    return QuantizedComparison(
        method=method,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        base=base,
        quantized=qres,
        base_bytes=weight_bytes(model),
        quantized_bytes=weight_bytes(qmodel),
        backend=info.backend,
        linear_layers=info.linears,
        packed_twice=any(isinstance(m, BF16Linear) and m.packed for m in qmodel.modules()),
    )
