"""The optimizer and schedule contract: options bases and helpers every optimizer/schedule uses.

It sits at the contract layer beside :mod:`llmkit.contracts` (and imports only
:mod:`llmkit.options`, where the options bases and the schedule helpers are defined without
torch): the built-in optimizers and schedules in ``llmkit.components``, plugins' ones (through
``from llmkit import ...``) and the trainer build on it.

Optimizers are built as ``build(model, options)`` from :func:`param_groups`; every group of
every built-in optimizer carries ``initial_lr``. Schedules are built as
``build(options, total_steps=...)`` and return the lr *factor* for a 0-based step, so the
trainer applies them to every group with :func:`set_lr_factor`
(``group["lr"] = group["initial_lr"] * factor``); this keeps groups with different base
learning rates (Muon's AdamW part) in proportion.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import _use_grad_for_differentiable

# The options bases and the schedule helpers are torch-free (a spec's optimizer and schedule
# are checked without torch): defined in llmkit.options, re-exported here.
from llmkit.options import Beta as Beta
from llmkit.options import OptimizerOptions as OptimizerOptions
from llmkit.options import ScheduleOptions as ScheduleOptions
from llmkit.options import WarmupOptions as WarmupOptions
from llmkit.options import check_steps as check_steps
from llmkit.options import decay_curve as decay_curve
from llmkit.options import linear_warmup as linear_warmup
from llmkit.options import schedule_stable_end as schedule_stable_end
from llmkit.options import schedule_warmup as schedule_warmup


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
