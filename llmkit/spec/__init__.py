"""Spec files: what a user writes, read (TOML/YAML, ``extends``, presets, ``--set``), checked
in two passes against the registry, and resolved into components.

- :mod:`llmkit.spec.models`: the outer structure (pass one), as pydantic models;
- :mod:`llmkit.spec.sections`: the component tables each registered kind declares;
- :mod:`llmkit.spec.files`: reading files, ``extends`` chains, presets and ``--set``;
- :mod:`llmkit.spec.resolve`: two-pass resolution and cross-component checks;
- :mod:`llmkit.spec.limits`: checks of the whole spec that need no data (sizes, schedule,
  BPE vocabulary), and fitting the warmup to a shorter ``--max-steps``;
- :mod:`llmkit.spec.resolved`: the resolved form (:class:`ResolvedSpec`, :class:`LayerPlan`);
- :mod:`llmkit.spec.schema`: the JSON Schema of a spec, one branch per registered component.
"""

from llmkit.spec.files import (
    PRESETS_DIR,
    apply_override,
    load_raw,
    merge,
    parse_value,
    presets,
    read_spec_file,
)
from llmkit.spec.limits import MAX_PARAMETERS, estimate_parameters, fit_warmup
from llmkit.spec.models import (
    ComponentRef,
    DataSpec,
    LayerOverride,
    LayerSelector,
    ModelSpec,
    Spec,
    Strict,
    TokenizerSpec,
    TrainSpec,
)
from llmkit.spec.resolve import acts_on, load_spec, load_spec_dict, resolve, select_layers
from llmkit.spec.resolved import LayerPlan, Resolved, ResolvedSpec
from llmkit.spec.sections import layer_kinds, spec_kinds

__all__ = [
    "MAX_PARAMETERS",
    "PRESETS_DIR",
    "ComponentRef",
    "DataSpec",
    "LayerOverride",
    "LayerPlan",
    "LayerSelector",
    "ModelSpec",
    "Resolved",
    "ResolvedSpec",
    "Spec",
    "Strict",
    "TokenizerSpec",
    "TrainSpec",
    "acts_on",
    "apply_override",
    "estimate_parameters",
    "fit_warmup",
    "layer_kinds",
    "load_raw",
    "load_spec",
    "load_spec_dict",
    "merge",
    "parse_value",
    "presets",
    "read_spec_file",
    "resolve",
    "select_layers",
    "spec_kinds",
]
