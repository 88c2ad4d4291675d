"""The options of every loss, in one module that imports no torch.

The plugin registers each loss with ``options="llmkit_losses.options:<Class>"``, so
``llmkit validate``, ``llmkit show`` and ``llmkit schema`` check a spec's ``train.loss`` against
these models without importing the losses (and torch). The loss modules import their options
from here and keep them under their old names (``llmkit_losses.base.LossOptions``,
``llmkit_losses.z_loss.Options``, ``ZLoss.Options``, ...).
"""

from __future__ import annotations

from pydantic import Field

from llmkit import ComponentOptions

#: The target value left out of a loss by default (PyTorch's ``ignore_index``).
IGNORE_INDEX = -100


class LossOptions(ComponentOptions):
    """Options every loss shares."""

    ignore_index: int = Field(
        IGNORE_INDEX, description="Targets with this value are left out (padding, prompts)."
    )


class CrossEntropyOptions(LossOptions):
    """Options of the cross-entropy loss."""


class LabelSmoothingOptions(LossOptions):
    """Options of the label-smoothing loss."""

    smoothing: float = Field(
        0.1, ge=0.0, lt=1.0, description="ε: the probability mass spread uniformly."
    )


class ZLossOptions(LossOptions):
    """Options of the z-loss objective."""

    weight: float = Field(1e-4, ge=0.0, description="Coefficient of log²Z (PaLM: 1e-4).")
