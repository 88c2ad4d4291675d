"""The optimizer and schedule contract: options bases and helpers every optimizer/schedule uses.

It sits at the contract layer beside :mod:`llmkit.contracts` (and imports only it): the
built-in optimizers and schedules in ``llmkit.components``, plugins' ones (through
``from llmkit import ...``) and the trainer build on it.

Optimizers are built as ``build(model, options)`` from :func:`param_groups`; every group of
every built-in optimizer carries ``initial_lr``. Schedules are built as
``build(options, total_steps=...)`` and return the lr *factor* for a 0-based step, so the
trainer applies them to every group with :func:`set_lr_factor`
(``group["lr"] = group["initial_lr"] * factor``); this keeps groups with different base
learning rates (Muon's AdamW part) in proportion.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Self

import torch
from pydantic import Field
from torch import nn
from torch.optim.optimizer import _use_grad_for_differentiable

from llmkit.contracts import ComponentOptions

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


def _head_module(name: str) -> bool:
    return any(part.startswith("lm_head") for part in name.split("."))


def embedding_like(model: nn.Module, *, include_head: bool = True) -> set[int]:
    """Ids of the parameters of ``nn.Embedding`` modules and, if ``include_head``, of
    modules whose name (or a dotted part of it) starts with ``lm_head``.

    A head tied to an embedding shares its parameter, so it is covered either way.
    """
    ids: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or (include_head and _head_module(name)):
            ids.update(id(p) for p in module.parameters(recurse=False))
    return ids


def param_groups(
    model: nn.Module,
    weight_decay: float,
    *,
    decay_norms_and_biases: bool = False,
    decay_embeddings: bool = False,
) -> list[dict[str, Any]]:
    """Split the trainable parameters into a ``decay`` and a ``no_decay`` group.

    Parameters with fewer than 2 dimensions (norm weights, biases) and embedding tables
    (with a head tied to them) are not decayed unless the matching flag is set. Shared
    parameters appear once; parameters without ``requires_grad`` are left out; empty groups
    are dropped. Each group has ``params``, ``weight_decay`` and ``group_name``.
    """
    embeddings = embedding_like(model, include_head=False)
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():  # named_parameters skips duplicates (tied weights)
        if not p.requires_grad:
            continue
        is_norm_or_bias = p.ndim < 2 and not decay_norms_and_biases
        is_embedding = id(p) in embeddings and not decay_embeddings
        (no_decay if is_norm_or_bias or is_embedding else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "group_name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "group_name": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


def param_groups_for(model: nn.Module, options: OptimizerOptions) -> list[dict[str, Any]]:
    """:func:`param_groups` with the settings of an optimizer's options."""
    return param_groups(
        model,
        options.weight_decay,
        decay_norms_and_biases=options.decay_norms_and_biases,
        decay_embeddings=options.decay_embeddings,
    )


def _wrapper_code(decorator: Callable[..., Any]) -> Any:
    """The code object of the wrapper ``decorator`` puts around a function."""
    return decorator(lambda *args, **kwargs: None).__code__


#: Code of torch's wrappers that keep ``torch._dynamo`` out of an optimizer's methods (each
#: imports dynamo on first call), and of the step's hooks wrapper. (``functools.wraps``
#: copies the wrapped function's names, so the code object is what tells them apart.)
_DYNAMO_WRAPPERS = (
    _wrapper_code(torch._disable_dynamo),
    _wrapper_code(_use_grad_for_differentiable),
)
_HOOK_WRAPPER = (_wrapper_code(torch.optim.Optimizer.profile_hook_step),)


def dynamo_loaded() -> bool:
    """Whether this process has imported ``torch._dynamo`` (nothing is compiled before)."""
    return "torch._dynamo" in sys.modules


def _strip(func: Callable[..., Any], wrappers: tuple[Any, ...]) -> Callable[..., Any]:
    """``func`` without the outer wrappers whose code is in ``wrappers``."""
    while getattr(func, "__code__", None) in wrappers and hasattr(func, "__wrapped__"):
        func = func.__wrapped__
    return func


class EagerOptimizer(torch.optim.Optimizer):
    """An optimizer base that imports no ``torch._dynamo`` while the process has not.

    ``torch.optim`` wraps ``step``, ``zero_grad``, ``add_param_group``, ``state_dict`` and
    ``load_state_dict`` so that dynamo leaves them alone when it traces, and each wrapper
    imports dynamo (1–2 s with sympy, more than a small run's training) on its first call.
    Code can only be traced once dynamo is imported, so until then these methods call torch's
    own functions without the wrappers (``step`` under ``set_grad_enabled(differentiable)``,
    as the wrapper sets it); once anything has imported dynamo (``torch.compile``) they call
    the wrapped ones. Put it first among the bases: ``class AdamW(EagerOptimizer,
    torch.optim.AdamW)``, or alone for an optimizer of one's own.
    """

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(super(), name)
        if dynamo_loaded():
            return method(*args, **kwargs)
        return _strip(method.__func__, _DYNAMO_WRAPPERS)(self, *args, **kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._call("add_param_group", param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._call("zero_grad", set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._call("load_state_dict", state_dict)

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        # The next class's step without its hooks wrapper (this class's step has its own).
        step = _strip(super().step.__func__, _HOOK_WRAPPER)
        if dynamo_loaded():
            return step(self, closure)
        with torch.set_grad_enabled(bool(self.defaults.get("differentiable", False))):
            return _strip(step, _DYNAMO_WRAPPERS)(self, closure)


class AdamW(EagerOptimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` (see :class:`EagerOptimizer`)."""


class SGD(EagerOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` (see :class:`EagerOptimizer`)."""


class Adafactor(EagerOptimizer, torch.optim.Adafactor):
    """``torch.optim.Adafactor`` (see :class:`EagerOptimizer`)."""


def set_initial_lr(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Record each group's base learning rate as ``group["initial_lr"]`` (if unset)."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", float(group["lr"]))
    return optimizer


def set_lr_factor(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Set every group's lr to ``initial_lr · factor`` (the factor a schedule returns)."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * factor


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
