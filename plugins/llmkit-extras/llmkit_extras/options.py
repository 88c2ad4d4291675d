"""The options of every llmkit-extras component, in one module that imports no torch.

The plugin registers each component with ``options="llmkit_extras.options:<Class>"``, so
``llmkit validate``, ``llmkit show`` and ``llmkit schema`` check a spec's options against these
models without importing the component modules (and torch). The component modules import their
options from here and keep them under their old names (``DynamicTanh.Options``,
``llmkit_extras.ademamix.Options``, ...).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from llmkit import Beta, ComponentOptions, OptimizerOptions, ScheduleOptions

# -- norms ----------------------------------------------------------------------------------------


class DyTOptions(ComponentOptions):
    """Options of Dynamic Tanh."""

    alpha_init: float = Field(0.5, gt=0.0, description="Initial value of the learned scalar α.")
    bias: bool | None = Field(
        None, description="Learn the additive bias; unset follows the model's bias setting."
    )


class ScaleNormOptions(ComponentOptions):
    """Options of ScaleNorm."""

    eps: float = Field(1e-5, gt=0.0, description="Lower bound of the norm ‖x‖ (no division by 0).")
    scale_init: float | None = Field(
        None, gt=0.0, description="Initial g; unset = √d as in the paper."
    )


# -- q/k transforms -------------------------------------------------------------------------------


class QKNormOptions(ComponentOptions):
    """Options of QK-norm."""

    gain: Literal["vector", "scalar", "none"] = Field(
        "vector",
        description="Learned gain after normalizing: vector (one per head dimension, shared "
        "by the heads, as OLMo 2, Qwen3 and Gemma 3), scalar (one number) or none.",
    )
    shared: bool = Field(
        False, description="One gain for q and k instead of one each (with a gain)."
    )
    eps: float = Field(1e-6, gt=0.0, description="Added to the mean square of q and k.")


# -- optimizers -----------------------------------------------------------------------------------


class AdEMAMixOptions(OptimizerOptions):
    """AdEMAMix options. The paper's LLM runs: betas (0.9, 0.999, 0.9999), alpha 5-10,
    alpha_beta3_warmup = the run's length, and the same lr and weight decay as AdamW."""

    betas: tuple[Beta, Beta, Beta] = Field(
        (0.9, 0.999, 0.9999),
        description="(β1 fast EMA, β2 second moment, β3 slow EMA)",
    )
    alpha: float = Field(5.0, ge=0.0, description="Weight of the slow EMA in the update")
    alpha_beta3_warmup: int | None = Field(
        None,
        ge=1,
        description="Steps over which α rises from 0 and β3 from β1 (the paper: the whole run; "
        "set it to train.max_steps); unset = no warmup",
    )
    eps: float = Field(1e-8, gt=0, description="Denominator epsilon")

    @model_validator(mode="after")
    def _warmup_needs_beta1(self) -> AdEMAMixOptions:
        if self.alpha_beta3_warmup is not None and self.betas[0] <= 0.0:
            raise ValueError("alpha_beta3_warmup needs β1 > 0 (β3 warms up from β1)")
        return self


# -- schedules ------------------------------------------------------------------------------------


class RexOptions(ScheduleOptions):
    """REX schedule options."""

    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Final lr as a fraction of the base lr"
    )
