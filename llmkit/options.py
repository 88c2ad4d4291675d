"""The bases of every component's options, and what the core asks of them: torch-free.

A spec is read, resolved and checked (``llmkit validate``, ``llmkit show``, ``llmkit schema``)
through its components' pydantic ``Options`` models alone, without their ``nn.Module`` code.
So the bases those models subclass live here, apart from :mod:`llmkit.contracts` and
:mod:`llmkit.optim` (which import torch and re-export these names, as ``from llmkit import
...`` does): :class:`ComponentOptions` (with :class:`NoOptions` and :class:`AdapterOptions`)
and the optimizer and schedule bases (:class:`OptimizerOptions`, :class:`WarmupOptions`,
:class:`ScheduleOptions`), with the helpers those options and the built-in schedules use
(:func:`ffn_hidden`; :func:`check_steps`, :func:`linear_warmup`, :func:`decay_curve`), so that
checking a spec's schedule against its run length builds the schedule without torch.

llmkit's own components keep their options in one torch-free module per kind,
``llmkit.components.<kind>.options``, which ``registry.toml`` names as each component's
``options``.

This is the bottom layer, with :mod:`llmkit.contracts`: it imports no other part of llmkit.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field

# -- every component ---------------------------------------------------------------------------


class ComponentOptions(BaseModel):
    """Base of every component's options: unknown keys and non-finite floats (inf, nan)
    are rejected.

    Besides the values, options state facts about the component they build, which the core
    asks instead of reading option names (a plugin's options inherit the defaults below and
    override what differs): :meth:`parameter_count` (a spec's size estimate),
    :meth:`effective` and :attr:`training_only` (what a Hugging Face export compares), and
    :attr:`needs_base_weights` (``llmkit validate``: adapters need ``train.init_from``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    #: Options that change only how the component trains (dropout, auxiliary-loss
    #: coefficients), never what the trained weights compute: an export leaves them out.
    training_only: ClassVar[frozenset[str]] = frozenset()
    #: The component adapts weights trained before (adapters): training needs them
    #: (``train.init_from``), which ``llmkit validate`` checks for spec files.
    needs_base_weights: ClassVar[bool] = False

    def parameter_count(self, d_model: int, bias: bool) -> int | None:
        """The parameters of the component these options build in a model of width
        ``d_model`` whose linear layers have biases when ``bias`` (unless the options say
        otherwise), or None when the options do not say (the default). Feed-forward options
        say it: the spec's size estimate (:func:`llmkit.spec.estimate_parameters`) sums it,
        with a generic estimate for an ffn whose options return None."""
        return None

    def effective(self, d_model: int, bias: bool) -> dict[str, Any]:
        """The options as they take effect in a model of width ``d_model`` and bias setting
        ``bias``, as JSON values: what the component derives from them is spelled out, so
        options that build the same computation give equal mappings. By default every
        option, with an unset ``bias`` (None: the convention "follows the model's bias
        setting") replaced by ``bias``; override to resolve other derived values (an ffn's
        hidden size from its multiplier)."""
        out = self.model_dump(mode="json")
        if "bias" in out and out["bias"] is None:
            out["bias"] = bias
        return out


class NoOptions(ComponentOptions):
    """For components without options."""


def ffn_hidden(d_model: int, hidden: int | None, multiplier: float, multiple_of: int) -> int:
    """Hidden size: ``hidden`` if given, else ``multiplier·d_model`` rounded up to
    ``multiple_of``."""
    if hidden:
        return hidden
    raw = int(multiplier * d_model)
    return multiple_of * math.ceil(raw / multiple_of)


class AdapterOptions(ComponentOptions):
    """Options every adapter component has (its own ``Options`` subclass this): which linear
    layers get an adapter, and which other parameters train (and are saved) beside them.
    Adapters adapt base weights (:attr:`needs_base_weights`)."""

    needs_base_weights: ClassVar[bool] = True

    targets: list[str] = Field(
        default_factory=lambda: ["attn.qkv", "attn.out_proj"],
        min_length=1,
        description="Glob patterns over the dotted names of linear layers (a pattern may match "
        "the end of a name: 'attn.qkv' is every layer's fused q/k/v projection; 'ffn.*', '*').",
    )
    also_train: list[str] = Field(
        default_factory=list,
        description="Glob patterns over parameter names that train in full beside the "
        "adapters (e.g. 'tok_emb.weight' after a vocabulary resize, '*norm*').",
    )


# -- optimizers --------------------------------------------------------------------------------

#: A momentum/averaging coefficient in [0, 1).
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class OptimizerOptions(ComponentOptions):
    """Options every built-in optimizer shares."""

    lr: float = Field(3e-4, gt=0, description="Peak learning rate (schedules scale it)")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay coefficient")
    decay_norms_and_biases: bool = Field(
        False, description="Also decay 1-D parameters (norm weights, biases)"
    )
    decay_embeddings: bool = Field(
        False, description="Also decay embedding tables (and an output head tied to them)"
    )


# -- schedules ---------------------------------------------------------------------------------


class WarmupOptions(ComponentOptions):
    """Options of a schedule with a linear warmup only.

    The schedule contract's facts about a run of ``max_steps`` steps, which the core asks
    instead of reading option names (``llmkit validate``, ``--max-steps``, a sweep's
    ``branch_budgets``): :meth:`warmup` and :meth:`stable_end`; and how to set the warmup
    (``--max-steps`` scales it down): :attr:`warmup_option` and :meth:`with_warmup`.
    Override them where the options say these otherwise.
    """

    warmup_steps: int = Field(0, ge=0, description="Steps of linear warmup from lr/warmup_steps")

    #: The option that sets the warmup, in steps (``--set schedule.<it>=N`` sets a warmup of
    #: N steps); None where no option does (the warmup is then never scaled down).
    warmup_option: ClassVar[str | None] = "warmup_steps"

    def with_warmup(self, steps: int) -> Self:
        """These options with a warmup of ``steps`` steps: :attr:`warmup_option` set to it."""
        if self.warmup_option is None:
            raise ValueError(f"{type(self).__name__} has no option that sets the warmup")
        return self.model_copy(update={self.warmup_option: steps})

    def warmup(self, max_steps: int) -> int:
        """The steps of warmup in a run of ``max_steps`` steps: ``warmup_steps``."""
        return self.warmup_steps

    def stable_end(self, max_steps: int) -> int | None:
        """The step at which the stable (constant, peak-lr) phase of a run of ``max_steps``
        steps ends and the decay starts, or None: no stable phase to branch a shorter run
        from (the default; WSD has one)."""
        return None


class ScheduleOptions(WarmupOptions):
    """Options of a schedule that decays towards a floor (with :meth:`warmup` and
    :meth:`stable_end` as :class:`WarmupOptions`)."""

    min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Final lr as a fraction of the base lr"
    )


def schedule_warmup(options: object, max_steps: int) -> int:
    """A schedule's warmup (its options' ``warmup``) in a run of ``max_steps`` steps; 0 for
    options that do not declare one."""
    warmup = getattr(options, "warmup", None)
    return warmup(max_steps) if callable(warmup) else 0


def schedule_stable_end(options: object, max_steps: int) -> int | None:
    """A schedule's stable end (its options' ``stable_end``) in a run of ``max_steps``
    steps; None for options that do not declare one (no stable phase)."""
    stable_end = getattr(options, "stable_end", None)
    return stable_end(max_steps) if callable(stable_end) else None


def check_steps(warmup_steps: int, total_steps: int, schedule: str) -> None:
    """Raise ``ValueError`` unless ``0 ≤ warmup_steps ≤ total_steps`` and ``total_steps ≥ 1``."""
    if total_steps < 1:
        raise ValueError(f"schedule {schedule!r}: total_steps must be ≥ 1, got {total_steps}")
    if warmup_steps > total_steps:
        raise ValueError(
            f"schedule {schedule!r}: warmup_steps ({warmup_steps}) exceeds "
            f"total_steps ({total_steps})"
        )


def linear_warmup(step: int, warmup_steps: int) -> float:
    """Warmup factor: ``(step + 1) / warmup_steps`` while ``step < warmup_steps``, else 1.

    As in nanoGPT, step 0 already trains at ``lr / warmup_steps`` and the last warmup step
    reaches the full lr.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 1.0


def decay_curve(progress: float, shape: str) -> float:
    """A decay from 1 at ``progress = 0`` to 0 at ``progress = 1`` (clamped outside).

    ``linear``: 1 − p; ``cosine``: (1 + cos πp)/2; ``sqrt``: 1 − √p (Hägele et al. 2024).
    """
    p = min(max(progress, 0.0), 1.0)
    if shape == "linear":
        return 1.0 - p
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    if shape == "sqrt":
        return 1.0 - math.sqrt(p)
    raise ValueError(f"unknown decay shape {shape!r}; expected linear, cosine or sqrt")
