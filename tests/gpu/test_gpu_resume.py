"""Exact resume on the device: a run stopped at step 15 and resumed gives the uninterrupted
run's losses bit for bit.

The run is stopped the way a hyperparameter search prunes one (``train(..., on_eval=...)``
returning True after the evaluation at step 15, which saves checkpoint step-000015), then
continued with ``train(run_dir=..., resume=True)`` as ``llmkit train --resume`` does. The
uninterrupted run is the shared 30-step run of the same spec. As in the CPU resume tests
(tests/training/test_train.py), the logged losses (rounded to 6 decimals by the trainer) and
validation losses must be equal, not close: the checkpoint restores weights, optimizer
moments, data position and RNG exactly, and the step is deterministic.

That holds only where training itself is deterministic. The first 15 steps of the stopped
run are a second run of the uninterrupted one's first 15, so they are compared first: with
``flash`` (our Triton kernel writes every gradient element once, in a fixed order) they must
be equal. PyTorch's SDPA flash backward accumulates dQ with atomic adds on CUDA unless
deterministic algorithms are requested, so with ``sdpa`` two runs may differ from the first
backward on; the test then reports that as an expected failure (xfail) instead of blaming the
resume.
"""

from __future__ import annotations

import pytest

from llmkit.training import train
from tests.gpu.common import CUDA, HALF, STEPS, VARIANTS, quiet, read_metrics, write_spec


def losses(run) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in read_metrics(run) if "loss" in m]


def val_losses(run) -> list[tuple[int, float]]:
    return [(m["step"], m["val_loss"]) for m in read_metrics(run) if "val_loss" in m]


@pytest.mark.parametrize("variant", ["flash", "sdpa"])
def test_a_resumed_run_reproduces_the_uninterrupted_losses(runs, tmp_path, variant):
    full = runs(variant).dir
    spec = write_spec(tmp_path, VARIANTS[variant][0])
    run = tmp_path / "run"
    evaluated: list[int] = []

    def stop_at_half(step: int, _val_loss: float) -> bool:
        evaluated.append(step)
        return step == HALF

    first = train(spec, run_dir=run, on_eval=stop_at_half, **quiet())
    assert (first.stopped, first.step, evaluated) == ("pruned", HALF, [HALF])
    assert (run / "checkpoints" / f"step-{HALF:06d}").is_dir()

    if losses(run) != losses(full)[:HALF]:
        why = (
            f"{variant}: two runs of the same {HALF} steps differ on {'cuda' if CUDA else 'cpu'}"
            f" (training is not deterministic, so resume cannot be checked bit for bit):\n"
            f"{losses(run)}\n{losses(full)[:HALF]}"
        )
        if variant == "sdpa" and CUDA:
            pytest.xfail(why)
        pytest.fail(why)

    second = train(None, run_dir=run, resume=True, **quiet())
    assert (second.stopped, second.step) == ("max_steps", STEPS)
    assert losses(run) == losses(full) and len(losses(full)) == STEPS
    assert val_losses(run) == val_losses(full)
