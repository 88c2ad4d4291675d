"""Deprecated: the component contracts moved to :mod:`llmkit.contracts` and are public as
``from llmkit import ...``. This module keeps plugins written against it loading."""

from __future__ import annotations

import warnings

from llmkit.contracts import (  # noqa: F401  (re-exported for old plugins)
    POSITION_SITES,
    AttentionKernel,
    BuildContext,
    ComponentOptions,
    DistanceBias,
    NoOptions,
    PositionalScheme,
    SideOutputs,
    ffn_hidden,
)

warnings.warn(
    "llmkit.components.base is deprecated: import these names from llmkit "
    "(from llmkit import BuildContext, ComponentOptions, ...)",
    DeprecationWarning,
    stacklevel=2,
)
