"""The conformance check of a component's declared tensor-parallel plan.

A model component may declare ``tensor_parallel_plan(self, tp)`` (see
:mod:`llmkit.parallel.tensor`); one that does not is refused under ``train.parallel.tp > 1``
and passes this check. A declared plan must return, for ``tp = 1`` (which divides every
size), a dict whose keys name the component itself (``""``) or its submodules and whose
values are ``torch.distributed.tensor.parallel`` styles.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llmkit.testing.common import Record, _expect, _run

#: Kinds whose components are modules built as ``Component(options, ctx)`` and may declare a plan.
PLANNED_KINDS = ("attention", "ffn", "norm", "position", "qk_transform")


def check_parallel_plan(record: Record, module: nn.Module) -> None:
    """Check ``module``'s declared plan, if it declares one (see the module docstring)."""
    method = getattr(module, "tensor_parallel_plan", None)
    if method is None:
        return
    from torch.distributed.tensor.parallel.style import ParallelStyle

    plan: Any = _run(record, "calling tensor_parallel_plan(1)", method, 1)
    _expect(
        isinstance(plan, dict),
        record,
        f"tensor_parallel_plan returned {type(plan).__name__}, not a dict",
    )
    names = {name for name, _ in module.named_modules()}
    for path, style in plan.items():
        _expect(
            path in names,
            record,
            f"tensor_parallel_plan names {path!r}, which is not the component or a submodule",
        )
        _expect(
            isinstance(style, ParallelStyle),
            record,
            f"tensor_parallel_plan maps {path!r} to {type(style).__name__}, not a ParallelStyle",
        )
