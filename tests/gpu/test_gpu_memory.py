"""Memory stays flat across training steps (``sdpa`` and ``flash``, eager).

The shared 30-step runs log, through a ``logger`` component (tests/gpu/common.py,
``MemoryLogger``), the memory in use right after each step and the peak during it. From step
10 on (the optimizer's state exists from step 1; the allocator has warmed up):

- memory in use after a step never exceeds step 10's by more than ``MEMORY_SLACK``: on CUDA
  4 KiB, less than one leaked 0-dim tensor a step over 20 steps (what keeping each step's
  loss or gradient norm on the device would leak);
- the peak of each step from 11 on stays within ``PEAK_SLACK`` (1 MiB on CUDA) of the
  highest peak of steps 10–14, except step 16, whose peak includes the evaluation and the
  checkpoint of step 15.

On a CPU these are the resident and peak resident sizes of the process (16 MiB slack): only
the test's logic is checked there.
"""

from __future__ import annotations

import pytest

from tests.gpu.common import HALF, MEMORY_FROM, MEMORY_SLACK, PEAK_SLACK, STEPS, memory_lines


@pytest.mark.parametrize("variant", ["sdpa", "flash"])
def test_memory_does_not_grow_across_steps(runs, e2e_report, variant):
    lines = {m["step"]: m for m in memory_lines(runs(variant).dir)}
    assert sorted(lines) == list(range(1, STEPS + 1))
    base = lines[MEMORY_FROM]["allocated"]
    grown = {s: lines[s]["allocated"] - base for s in range(MEMORY_FROM, STEPS + 1)}
    worst = max(grown, key=grown.__getitem__)
    peak = max(lines[s]["peak"] for s in range(MEMORY_FROM, MEMORY_FROM + 5))
    later = {s: lines[s]["peak"] for s in range(MEMORY_FROM + 1, STEPS + 1) if s != HALF + 1}
    high = max(later, key=later.__getitem__)
    e2e_report.append(
        f"memory {variant}: {base:,} B in use after step {MEMORY_FROM}, at most "
        f"{grown[worst]:+,} B later; step peak {peak:,} B, at most {later[high] - peak:+,} B later"
    )
    assert grown[worst] <= MEMORY_SLACK, (
        f"{variant}: {grown[worst]:,} bytes more in use after step {worst} than after step "
        f"{MEMORY_FROM} (slack {MEMORY_SLACK:,}); per step: {grown}"
    )
    assert later[high] <= peak + PEAK_SLACK, (
        f"{variant}: the peak of step {high} is {later[high] - peak:,} bytes above that of "
        f"steps {MEMORY_FROM}-{MEMORY_FROM + 4} ({peak:,}; slack {PEAK_SLACK:,})"
    )
