"""llmkit-losses: a new component kind, ``loss``, declared through ``register_kinds``.

A ``loss`` component maps ``(logits, targets)`` to the scalar a training step minimizes (the
contract is :class:`llmkit_losses.base.Loss`). The kind lives at ``train.loss`` in a spec
(optional: without it llmkit trains on the model's own cross-entropy)::

    [train]
    loss = { name = "z_loss", weight = 1e-4 }

and llmkit's trainer then minimizes that loss of the logits plus the model's auxiliary losses,
and reports it as the validation loss. The losses also work in your own training loop::

    from llmkit_losses import build_loss
    loss_fn = build_loss({"name": "z_loss", "weight": 1e-4})
    out = model(idx)                              # logits only
    loss = loss_fn(out.logits, targets) + sum(out.aux_losses.values())

They are listed and documented like every component (``llmkit list loss``, ``llmkit show
loss z_loss``) and checked by llmkit's conformance suite with the check the kind declares
(:func:`llmkit_losses.conformance.check_loss`).

This module imports neither torch nor the components: targets are lazy ``"module:attr"``, and
so are the options models, in the torch-free :mod:`llmkit_losses.options`, so ``llmkit
validate``, ``show`` and ``schema`` check a spec's ``train.loss`` without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from llmkit import hookimpl

__version__ = "0.1.0"

KIND = "loss"


@hookimpl
def register_kinds(register: Callable[..., None]) -> None:
    register(
        KIND,
        "Training objective: (logits, targets) → scalar, a mean over non-ignored targets",
        contract="llmkit_losses.base:Loss",
        section="train.loss",
        build="Loss(options) -> nn.Module; forward(logits (..., V), targets (...)) -> 0-dim",
        check="llmkit_losses.conformance:check_loss",
    )


@hookimpl
def register_components(register: Callable[..., Any]) -> None:
    register(
        KIND,
        "cross_entropy",
        "llmkit_losses.cross_entropy:CrossEntropy",
        summary="Mean token cross-entropy (negative log-likelihood of the targets)",
        options="llmkit_losses.options:CrossEntropyOptions",
    )
    register(
        KIND,
        "label_smoothing",
        "llmkit_losses.label_smoothing:LabelSmoothing",
        summary="Cross-entropy against targets smoothed towards uniform (Szegedy et al. 2016)",
        options="llmkit_losses.options:LabelSmoothingOptions",
    )
    register(
        KIND,
        "z_loss",
        "llmkit_losses.z_loss:ZLoss",
        summary="Cross-entropy plus weight·log²Z, keeping the softmax normalizer near 1 (PaLM)",
        options="llmkit_losses.options:ZLossOptions",
    )


def build_loss(ref: str | Mapping[str, Any] = "cross_entropy", registry: Any = None) -> Any:
    """Build a loss from a name or ``{"name": ..., <options>}``, looked up in the registry
    (so losses from other plugins work too) and validated by the loss's options model.

    ``registry`` defaults to llmkit's process registry, which loads this plugin unless
    ``$LLMKIT_PLUGINS`` leaves it out. Raises :class:`llmkit.LlmkitError` for an
    unknown loss or invalid options.
    """
    from pydantic import ValidationError

    from llmkit import LlmkitError, get_registry

    if registry is None:
        registry = get_registry()
    if KIND not in registry.kinds:
        raise LlmkitError(
            "no 'loss' kind in the registry: the llmkit-losses plugin is not loaded "
            "(is it left out of $LLMKIT_PLUGINS?)"
        )
    values = {"name": ref} if isinstance(ref, str) else dict(ref)
    name = values.pop("name", "cross_entropy")
    record = registry.get(KIND, name)
    try:
        options = record.parse_options(values)
    except ValidationError as exc:
        allowed = ", ".join(record.options_model().model_fields)
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or name
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown option {where!r} (allowed: {allowed})")
            else:
                problems.append(f"{where}: {err['msg']}")
        raise LlmkitError(f"loss {name!r}: {'; '.join(problems)}") from exc
    return record.load()(options)
