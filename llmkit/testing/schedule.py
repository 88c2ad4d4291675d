"""The ``schedule`` kind: factories ``build(options, *, total_steps) -> (step -> lr factor)``."""

from __future__ import annotations

import itertools
import math

import torch

from llmkit.testing.common import (
    Options,
    Record,
    _expect,
    _fail,
    _load,
    _option_fields,
    _run,
    build_options,
)


def check_schedule(
    record: Record,
    options: Options = None,
    *,
    total_steps: int = 100,
    warmup_steps: int = 10,
    device: str | torch.device | None = None,
) -> None:
    """Check a schedule factory ``build(options, *, total_steps) -> (step -> lr factor)``.

    With a ``warmup_steps`` option (set to ``warmup_steps`` unless given): the factor rises
    during warmup and reaches 1.0 at its end. Always: the peak is 1.0, the factor is never
    negative (also past ``total_steps``), non-increasing over the last 20% of steps, and a
    pure function of the step. ``device`` is accepted for a uniform signature and unused.
    """
    build = _load(record)
    fields = _option_fields(record)
    opts_dict = dict(options or {})
    if "warmup_steps" in fields:
        opts_dict.setdefault("warmup_steps", warmup_steps)
    opts = build_options(record, opts_dict)
    fn = _run(
        record, f"build({opts!r}, total_steps={total_steps})", build, opts, total_steps=total_steps
    )
    _expect(callable(fn), record, f"build returned {type(fn).__name__}, not a callable")
    steps = range(total_steps + total_steps // 5)
    values = []
    for s in steps:
        f = _run(record, f"the factor at step {s}", fn, s)
        try:
            f = float(f)
        except (TypeError, ValueError):
            _fail(record, f"the factor at step {s} is {f!r}, not a number")
        _expect(math.isfinite(f), record, f"the factor at step {s} is {f}")
        _expect(f >= 0, record, f"the factor at step {s} is negative ({f})")
        values.append(f)
    again = [float(fn(s)) for s in reversed(steps)][::-1]
    _expect(
        again == values,
        record,
        "the factor depends on call order or history, not only on the step (resuming from a "
        "checkpoint would change the schedule)",
    )
    peak = max(values[:total_steps])
    _expect(
        abs(peak - 1.0) <= 1e-3,
        record,
        f"the peak factor is {peak:.4f}; 1.0 (the optimizer's base lr) must be reached",
    )
    warm = getattr(opts, "warmup_steps", 0) or 0
    if warm > 1:
        ramp = values[:warm]
        _expect(
            all(b > a for a, b in itertools.pairwise(ramp)),
            record,
            f"the factor does not rise during {warm} warmup steps: {ramp}",
        )
        _expect(ramp[0] < 1.0, record, f"the factor at step 0 is already {ramp[0]} despite warmup")
        _expect(
            abs(max(values[warm - 1], values[warm]) - 1.0) <= 1e-3,
            record,
            f"the factor at the end of warmup (steps {warm - 1}, {warm}) is "
            f"{values[warm - 1]:.4f}, {values[warm]:.4f}, not 1.0",
        )
    tail_start = total_steps - total_steps // 5
    tail = values[tail_start:total_steps]
    for i, (a, b) in enumerate(itertools.pairwise(tail)):
        _expect(
            b <= a + 1e-9,
            record,
            f"the factor increases from step {tail_start + i} ({a:.4f}) to "
            f"{tail_start + i + 1} ({b:.4f}) in the last 20% of {total_steps} steps",
        )
    if "warmup_steps" in fields and "warmup_steps" not in dict(options or {}):
        zero = build_options(record, {**opts_dict, "warmup_steps": 0})
        fn0 = _run(record, "build with warmup_steps=0", build, zero, total_steps=total_steps)
        _expect(
            abs(float(fn0(0)) - 1.0) <= 1e-3,
            record,
            f"with warmup_steps=0 the factor at step 0 is {float(fn0(0)):.4f}, not 1.0",
        )
