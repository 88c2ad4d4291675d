"""30 training steps with each attention kernel, eager and compiled, give sdpa's losses.

Every run trains the same 2-layer model (d_model 128, 4 heads, ctx 128, RoPE) from the same
seed on the same batches, in bf16 autocast as a GPU run does (``llmkit train`` through
``llmkit.training.train``), and differs from the eager ``sdpa`` run only in
``model.attention`` and ``train.compile``. Compared with that run:

- step 1 (same weights, same batch): the loss within ``FIRST_ATOL`` (2e-3) and the gradient
  norm within ``FIRST_GRAD_RTOL`` (2 %): forward and backward agree before any update can
  amplify a difference;
- every step's loss within ``LOSS_ATOL`` (2e-2) and the last within ``FINAL_RTOL`` (1 %), and
  both validation losses (steps 15 and 30) within ``LOSS_ATOL``: the trajectories stay
  together under bf16 rounding (tests/gpu/common.py says why these sizes separate rounding
  from a broken kernel);
- the run learns: its last 5 losses average at least ``MIN_LEARNED`` (0.5) below step 1's.

``sliding_window`` runs twice: with a window as long as the block (full causal attention,
against sdpa) and with a 32-key window against ``dense`` with the same window, so the band
masking of the kernel is checked end to end too. That the comparison can fail is checked as
well: the 32-key dense run against the full-attention sdpa run (a masking error of that size)
falls outside ``LOSS_ATOL`` (on the CPU: 0.14 apart at worst, 9 % at the last step).

With ``LLMKIT_GPU_TESTS_DEVICE=cpu``, ``sliding_window+compile`` runs the C window kernel
as the custom op ``llmkit::window_native_fwd/bwd`` (a GPU runs the Triton kernel instead).
"""

from __future__ import annotations

import math

import pytest

from tests.gpu.common import (
    FINAL_RTOL,
    FIRST_ATOL,
    FIRST_GRAD_RTOL,
    HALF,
    LOSS_ATOL,
    MIN_LEARNED,
    STEPS,
    read_metrics,
)

compiled = pytest.mark.compile

PAIRS = [
    ("flash", "sdpa"),
    ("sliding_window", "sdpa"),
    ("sliding_window_band", "dense_band"),
    pytest.param("sdpa+compile", "sdpa", marks=compiled),
    pytest.param("flash+compile", "sdpa", marks=compiled),
    pytest.param("sliding_window+compile", "sdpa", marks=compiled),
]


def val_losses(run) -> list[tuple[int, float]]:
    return [(m["step"], m["val_loss"]) for m in read_metrics(run.dir) if "val_loss" in m]


def assert_learns(run) -> None:
    losses = run.losses
    assert len(losses) == STEPS, f"{run.variant}: {len(losses)} logged steps"
    assert all(math.isfinite(x) for x in losses), f"{run.variant}: {losses}"
    late = sum(losses[-5:]) / 5
    assert late <= losses[0] - MIN_LEARNED, (
        f"{run.variant} did not learn: step 1 {losses[0]:.4f}, last 5 steps {late:.4f}"
    )


def test_the_reference_runs_learn(runs):
    for variant in ("sdpa", "dense_band"):
        assert_learns(runs(variant))


@pytest.mark.parametrize(("variant", "reference"), PAIRS)
def test_losses_equal_the_reference_within_bf16_rounding(runs, e2e_report, variant, reference):
    ref, run = runs(reference), runs(variant)
    assert_learns(run)
    a, b = run.losses, ref.losses
    diffs = [abs(x - y) for x, y in zip(a, b)]
    worst = max(range(STEPS), key=diffs.__getitem__)
    table = f"{variant} vs {reference}: max |Δloss| {diffs[worst]:.2e} at step {worst + 1}"
    g_run, g_ref = run.lines[0]["grad_norm"], ref.lines[0]["grad_norm"]
    e2e_report.append(
        f"{table}; step 1 |Δloss| {diffs[0]:.1e}, grad norm {abs(g_run / g_ref - 1):.1e} "
        f"relative; last step {abs(a[-1] / b[-1] - 1):.1e} relative"
    )

    assert diffs[0] <= FIRST_ATOL, f"step 1 loss {a[0]} vs {b[0]} ({table})"
    assert g_run == pytest.approx(g_ref, rel=FIRST_GRAD_RTOL), f"step 1 grad norm ({table})"
    assert diffs[worst] <= LOSS_ATOL, f"{table}\n{variant}: {a}\n{reference}: {b}"
    assert a[-1] == pytest.approx(b[-1], rel=FINAL_RTOL), table
    v_run, v_ref = val_losses(run), val_losses(ref)
    assert [s for s, _ in v_run] == [s for s, _ in v_ref] == [HALF, STEPS]
    for (step, x), (_, y) in zip(v_run, v_ref):
        assert abs(x - y) <= LOSS_ATOL, f"val loss at step {step}: {x} vs {y} ({table})"


def test_the_comparison_tells_a_different_attention_apart(runs, e2e_report):
    """A negative control: 32-key windows instead of full attention move the trajectory
    well past the tolerance, so a kernel with a masking error of that size would fail."""
    a, b = runs("dense_band").losses, runs("sdpa").losses
    worst = max(abs(x - y) for x, y in zip(a, b))
    e2e_report.append(f"negative control dense_band vs sdpa: max |Δloss| {worst:.2e}")
    assert worst > 2 * LOSS_ATOL
