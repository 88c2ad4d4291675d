"""llmkit: build language models from interchangeable, registry-resolved components.

The public API is what ``__all__`` lists, imported as ``from llmkit import name``:

- plugin hooks: ``hookimpl``; ``__version__``;
- options (torch-free, :mod:`llmkit.options`): ``ComponentOptions``, ``NoOptions``,
  ``AdapterOptions``, ``ffn_hidden``;
- contracts: ``BuildContext``, ``SideOutputs``, ``DistanceBias``, ``AttentionKernel``,
  ``PositionalScheme``, ``POSITION_SITES``, and the block seams ``Block``, ``BlockParts``,
  ``AttentionInputs``, ``QKTransform``, adapters' ``WeightAdapter``, trackers
  ``LoggerContext`` and ``MetricsLogger`` (:mod:`llmkit.contracts`);
- attention ops: ``reference_attention`` (the one reference every kernel matches),
  ``sdpa_attention``, ``check_shapes``, ``attention_mask`` (:mod:`llmkit.ops`);
- optimizers and schedules: ``OptimizerOptions``, ``ScheduleOptions``, ``WarmupOptions``,
  ``Beta``, ``check_steps``, ``linear_warmup``, ``decay_curve`` (:mod:`llmkit.options`),
  ``param_groups_for``, ``set_initial_lr``, ``set_lr_factor`` (:mod:`llmkit.optim`);
- tensor-parallel plans a component returns from ``tensor_parallel_plan(tp)``
  (:mod:`llmkit.parallel`): ``tp_column``, ``tp_row``, ``tp_sequence``, ``tp_heads``,
  ``tp_experts`` and the check ``tp_check_divides``;
- errors: ``LlmkitError``, ``SpecError``, ``RegistryError``, ``PluginError``;
- the registry: ``Registry``, ``get_registry``, ``reset_registry``, ``Kind``, ``Component``;
- specs and models: ``load_spec``, ``load_spec_dict``, ``resolve``, ``ResolvedSpec``,
  ``build_model``, ``Transformer``, ``ModelOutput``;
- runs: ``train`` (a spec to a run directory), ``load_run`` (a run's model, tokenizer and
  spec), ``Generator``, ``Sampling`` and ``GenerationError`` (text generation);
- the command line: ``cli_main(argv) -> exit code`` (what the ``llmkit`` script runs).

One public module besides: :mod:`llmkit.testing`, the conformance suite plugin authors run in
their own CI. Everything else (``llmkit.components.*``, ``llmkit.kernels.*``, ``llmkit.cli``
and the other subpackages) is internal and may change between releases; built-in components
are reached through the registry, never imported.

Importing this package is cheap: only ``hookimpl`` (pluggy) loads eagerly; every other name
imports its module on first access (PEP 562), so ``llmkit --help`` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from llmkit.hookspecs import hookimpl

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from llmkit.cli import main as cli_main
    from llmkit.contracts import (
        POSITION_SITES,
        AttentionInputs,
        AttentionKernel,
        Block,
        BlockParts,
        BuildContext,
        DistanceBias,
        LoggerContext,
        MetricsLogger,
        PositionalScheme,
        QKTransform,
        SideOutputs,
        WeightAdapter,
    )
    from llmkit.errors import LlmkitError, PluginError, RegistryError, SpecError
    from llmkit.inference import GenerationError, Generator, Sampling
    from llmkit.model import ModelOutput, Transformer, build_model
    from llmkit.ops import attention_mask, check_shapes, reference_attention, sdpa_attention
    from llmkit.optim import param_groups_for, set_initial_lr, set_lr_factor
    from llmkit.options import (
        AdapterOptions,
        Beta,
        ComponentOptions,
        NoOptions,
        OptimizerOptions,
        ScheduleOptions,
        WarmupOptions,
        check_steps,
        decay_curve,
        ffn_hidden,
        linear_warmup,
    )
    from llmkit.parallel.experts import expert_parallel as tp_experts
    from llmkit.parallel.tensor import HeadShards as tp_heads
    from llmkit.parallel.tensor import check_divides as tp_check_divides
    from llmkit.parallel.tensor import column as tp_column
    from llmkit.parallel.tensor import row as tp_row
    from llmkit.parallel.tensor import sequence as tp_sequence
    from llmkit.registry import Component, Kind, Registry, get_registry, reset_registry
    from llmkit.runs import load_run
    from llmkit.spec import ResolvedSpec, load_spec, load_spec_dict, resolve
    from llmkit.training import train

__version__ = "0.1.0"

#: Public name → the module that defines it (``"module:attribute"`` where the name differs).
_LAZY: dict[str, str] = {
    "POSITION_SITES": "llmkit.contracts",
    "AttentionInputs": "llmkit.contracts",
    "Block": "llmkit.contracts",
    "BlockParts": "llmkit.contracts",
    "QKTransform": "llmkit.contracts",
    "AttentionKernel": "llmkit.contracts",
    "BuildContext": "llmkit.contracts",
    "ComponentOptions": "llmkit.options",
    "DistanceBias": "llmkit.contracts",
    "NoOptions": "llmkit.options",
    "PositionalScheme": "llmkit.contracts",
    "SideOutputs": "llmkit.contracts",
    "ffn_hidden": "llmkit.options",
    "AdapterOptions": "llmkit.options",
    "WeightAdapter": "llmkit.contracts",
    "LoggerContext": "llmkit.contracts",
    "MetricsLogger": "llmkit.contracts",
    "attention_mask": "llmkit.ops",
    "check_shapes": "llmkit.ops",
    "reference_attention": "llmkit.ops",
    "sdpa_attention": "llmkit.ops",
    "Beta": "llmkit.options",
    "OptimizerOptions": "llmkit.options",
    "ScheduleOptions": "llmkit.options",
    "WarmupOptions": "llmkit.options",
    "check_steps": "llmkit.options",
    "decay_curve": "llmkit.options",
    "linear_warmup": "llmkit.options",
    "param_groups_for": "llmkit.optim",
    "set_initial_lr": "llmkit.optim",
    "set_lr_factor": "llmkit.optim",
    "tp_column": "llmkit.parallel.tensor:column",
    "tp_row": "llmkit.parallel.tensor:row",
    "tp_sequence": "llmkit.parallel.tensor:sequence",
    "tp_heads": "llmkit.parallel.tensor:HeadShards",
    "tp_experts": "llmkit.parallel.experts:expert_parallel",
    "tp_check_divides": "llmkit.parallel.tensor:check_divides",
    "LlmkitError": "llmkit.errors",
    "PluginError": "llmkit.errors",
    "RegistryError": "llmkit.errors",
    "SpecError": "llmkit.errors",
    "Component": "llmkit.registry",
    "Kind": "llmkit.registry",
    "Registry": "llmkit.registry",
    "get_registry": "llmkit.registry",
    "reset_registry": "llmkit.registry",
    "ResolvedSpec": "llmkit.spec",
    "load_spec": "llmkit.spec",
    "load_spec_dict": "llmkit.spec",
    "resolve": "llmkit.spec",
    "ModelOutput": "llmkit.model",
    "Transformer": "llmkit.model",
    "build_model": "llmkit.model",
    "Generator": "llmkit.inference",
    "Sampling": "llmkit.inference",
    "GenerationError": "llmkit.inference",
    "train": "llmkit.training",
    "load_run": "llmkit.runs",
    "cli_main": "llmkit.cli:main",
}

__all__ = [
    "POSITION_SITES",
    "AdapterOptions",
    "AttentionInputs",
    "AttentionKernel",
    "Beta",
    "Block",
    "BlockParts",
    "BuildContext",
    "Component",
    "ComponentOptions",
    "DistanceBias",
    "GenerationError",
    "Generator",
    "Kind",
    "LlmkitError",
    "LoggerContext",
    "MetricsLogger",
    "ModelOutput",
    "NoOptions",
    "OptimizerOptions",
    "PluginError",
    "PositionalScheme",
    "QKTransform",
    "Registry",
    "RegistryError",
    "ResolvedSpec",
    "Sampling",
    "ScheduleOptions",
    "SideOutputs",
    "SpecError",
    "Transformer",
    "WarmupOptions",
    "WeightAdapter",
    "__version__",
    "attention_mask",
    "build_model",
    "check_shapes",
    "check_steps",
    "cli_main",
    "decay_curve",
    "ffn_hidden",
    "get_registry",
    "hookimpl",
    "linear_warmup",
    "load_run",
    "load_spec",
    "load_spec_dict",
    "param_groups_for",
    "reference_attention",
    "reset_registry",
    "resolve",
    "sdpa_attention",
    "set_initial_lr",
    "set_lr_factor",
    "tp_check_divides",
    "tp_column",
    "tp_experts",
    "tp_heads",
    "tp_row",
    "tp_sequence",
    "train",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access and cache the name here."""
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'llmkit' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
