"""llmkit-extras: components registered through llmkit's ``register_components`` hook.

Every target is a lazy ``"module:attr"`` string, so loading this plugin (``llmkit list``,
``llmkit plugins``) imports neither torch nor the component modules; a component's module is
imported the first time a model, an optimizer or a schedule is built from it. Every options
model is a lazy ``"module:attr"`` string too, naming :mod:`llmkit_extras.options`, which imports
no torch: ``llmkit validate``, ``show`` and ``schema`` check a spec's options with it alone.
Capabilities declared here are what the spec resolver, the model's accounting and the
conformance suite read (see docs/plugins/contracts.md in the llmkit repository).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmkit import hookimpl

__version__ = "0.1.0"


@hookimpl
def register_components(register: Callable[..., Any]) -> None:
    register(
        "norm",
        "dyt",
        "llmkit_extras.dyt:DynamicTanh",
        summary="Dynamic Tanh, weight·tanh(α·x) + bias: a normalization-free norm "
        "replacement (Zhu et al. 2025)",
        options="llmkit_extras.options:DyTOptions",
    )
    register(
        "norm",
        "scalenorm",
        "llmkit_extras.scalenorm:ScaleNorm",
        summary="ScaleNorm, g·x/‖x‖ with one learned scalar (Nguyen & Salazar 2019)",
        options="llmkit_extras.options:ScaleNormOptions",
    )
    register(
        "optimizer",
        "ademamix",
        "llmkit_extras.ademamix:build",
        summary="AdEMAMix: AdamW plus a slow momentum EMA mixed into the update "
        "(Pagliardini et al. 2024)",
        options="llmkit_extras.options:AdEMAMixOptions",
    )
    register(
        "qk_transform",
        "qk_norm",
        "llmkit_extras.qk_norm:QKNorm",
        summary="RMS-normalized queries and keys (QK-norm) before positions and the kernel, "
        "bounding attention logits",
        options="llmkit_extras.options:QKNormOptions",
    )
    register(
        "schedule",
        "rex",
        "llmkit_extras.rex:build",
        summary="REX: warmup, then (1−p)/(½+½(1−p)) decay to the floor (Chen et al. 2022)",
        options="llmkit_extras.options:RexOptions",
    )
