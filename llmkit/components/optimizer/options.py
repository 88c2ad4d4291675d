"""The options of the built-in optimizers (torch-free: a spec is checked without torch), each a
:class:`llmkit.options.OptimizerOptions`."""

from __future__ import annotations

from typing import Self

from pydantic import Field, field_validator, model_validator

from llmkit.options import Beta, OptimizerOptions


class AdamWOptions(OptimizerOptions):
    """AdamW options."""

    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="Moment decay rates (β1, β2)")
    eps: float = Field(1e-8, gt=0, description="Denominator epsilon")
    fused: bool | None = Field(
        None,
        description="Use torch's fused kernel (None: where it supports the parameters — plain "
        "float tensors on one CPU or CUDA device — else torch's default implementation)",
    )


class SGDOptions(OptimizerOptions):
    """SGD options."""

    momentum: Beta = Field(0.9, description="Momentum coefficient (0: plain SGD)")
    nesterov: bool = Field(False, description="Use Nesterov momentum")
    dampening: float = Field(0.0, ge=0.0, le=1.0, description="Dampening of the momentum")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> Self:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov momentum requires momentum > 0 and dampening = 0")
        return self


class LionOptions(OptimizerOptions):
    """Lion options. Use an lr 3-10× smaller and a weight decay 3-10× larger than AdamW's."""

    lr: float = Field(1e-4, gt=0, description="Learning rate (the size of every sign step)")
    betas: tuple[Beta, Beta] = Field(
        (0.9, 0.99), description="(β1 interpolation for the update, β2 momentum decay)"
    )


class AdafactorOptions(OptimizerOptions):
    """Adafactor options (``torch.optim.Adafactor``)."""

    lr: float = Field(
        1e-2, gt=0, description="Upper bound of the relative step size ρ_t = min(lr, 1/√t)"
    )
    beta2_decay: float = Field(
        -0.8, le=0.0, description="Exponent of the second-moment decay β2_t = 1 − t^beta2_decay"
    )
    eps: tuple[float | None, float] = Field(
        (None, 1e-3),
        description="(ε1 added to squared gradients, None: dtype eps; ε2 floor of param RMS)",
    )
    d: float = Field(1.0, ge=1.0, description="Update clipping threshold")

    @field_validator("eps")
    @classmethod
    def _eps_non_negative(cls, eps: tuple[float | None, float]) -> tuple[float | None, float]:
        if (eps[0] is not None and eps[0] < 0) or eps[1] < 0:
            raise ValueError("eps values must be ≥ 0")
        return eps


class MuonOptions(OptimizerOptions):
    """Muon options. ``lr`` is Muon's (hidden matrices); ``adamw_lr`` the AdamW part's."""

    lr: float = Field(0.02, gt=0, description="Learning rate of the Muon (hidden-matrix) part")
    momentum: Beta = Field(0.95, description="Muon momentum coefficient")
    nesterov: bool = Field(True, description="Use Nesterov momentum in the Muon part")
    ns_steps: int = Field(5, ge=1, le=20, description="Newton–Schulz iterations")
    adamw_lr: float | None = Field(
        3e-4, gt=0, description="Learning rate of the AdamW part (None: same as lr)"
    )
    adamw_betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW (β1, β2)")
    adamw_eps: float = Field(1e-8, gt=0, description="AdamW denominator epsilon")
