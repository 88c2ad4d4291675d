"""The trainer end to end on a tiny corpus: metrics, checkpoints, resume, failures."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmkit.errors import LlmkitError
from llmkit.runs.checkpoints import Checkpoints
from llmkit.training import StepResult, train
from tests.conftest import ROOT
from tests.helpers import write_train_spec
from tests.training.kill_resume import (
    cli,
    losses,
    read_metrics,
    train_killed_and_resumed,
    val_losses,
)

CORPUS = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to "
    "famish?\n\nAll:\nResolved. resolved.\n\n"
) * 60


def write_spec(tmp_path: Path, **train) -> Path:
    return write_train_spec(tmp_path, CORPUS, dropout=0.1, **train)


def test_training_writes_the_run_directory(tmp_path):
    run = tmp_path / "run"
    result = train(write_spec(tmp_path), run_dir=run, log=lambda _m: None, progress=False)
    assert result.step == 20 and result.stopped == "max_steps"
    for name in (
        "spec.yaml",
        "resolved.json",
        "tokenizer.json",
        "metrics.jsonl",
        "model.safetensors",
        "loss.png",
    ):
        assert (run / name).is_file(), name
    lines = read_metrics(run)
    train_lines = [m for m in lines if "loss" in m]
    assert [m["step"] for m in train_lines] == list(range(1, 21))
    for key in ("lr", "grad_norm", "tokens_per_s", "tokens", "trained_tokens"):
        assert key in train_lines[-1]
    # Text trains on every target: no padding, so trained tokens are the tokens seen.
    assert train_lines[-1]["trained_tokens"] == train_lines[-1]["tokens"] == result.tokens
    assert result.trained_tokens == result.tokens
    assert "trained_tokens_per_s" not in train_lines[-1]  # it would equal tokens_per_s
    evals = [m for m in lines if "val_loss" in m]
    assert [m["step"] for m in evals] == [10, 20]
    # val_ce and val_ppl on every evaluation; for the cross-entropy val_loss is the same.
    assert all(m["val_ce"] == m["val_loss"] for m in evals)
    assert evals[-1]["val_ppl"] == pytest.approx(math.exp(evals[-1]["val_ce"]), rel=1e-3)
    assert result.val_ce == pytest.approx(evals[-1]["val_ce"], abs=1e-6)
    assert result.objective == "cross_entropy"
    assert train_lines[-1]["loss"] < train_lines[0]["loss"]  # it learns
    resolved = json.loads((run / "resolved.json").read_text())
    assert len(resolved["model"]["layers"]) == 2
    assert Checkpoints(run).latest().name == "step-000020"


def test_plot_false_draws_no_loss_curve(tmp_path, monkeypatch):
    import llmkit.runs.metrics as train_module

    monkeypatch.setattr(train_module, "PLOT_EVERY_S", 0.0)
    monkeypatch.setattr(train_module, "plot_losses", lambda *a: pytest.fail("plotted"))
    run = tmp_path / "run"
    spec = write_spec(tmp_path, max_steps=6, eval_interval=3, plot=False)
    assert train(spec, run_dir=run, log=lambda _m: None, progress=False).step == 6
    assert not (run / "loss.png").exists() and (run / "model.safetensors").is_file()


def test_loss_curve_is_drawn_during_training_at_most_every_plot_interval(tmp_path, monkeypatch):
    import llmkit.runs.metrics as train_module

    drawn: list[int] = []
    real = train_module.plot_losses
    monkeypatch.setattr(
        train_module, "plot_losses", lambda h, *a: drawn.append(h[-1]["step"]) or real(h, *a)
    )
    monkeypatch.setattr(train_module, "PLOT_EVERY_S", 3600.0)
    monkeypatch.setenv("LLMKIT_FAIL_AT", "0:8")  # a crash after the checkpoints of steps 3, 6
    run = tmp_path / "run"
    spec = write_spec(tmp_path, max_steps=20, eval_interval=3)
    with pytest.raises(RuntimeError, match="injected failure"):
        train(spec, run_dir=run, log=lambda _m: None, progress=False)
    assert drawn == [3] and (run / "loss.png").is_file()  # drawn during training, throttled
    monkeypatch.delenv("LLMKIT_FAIL_AT")
    monkeypatch.setattr(train_module, "PLOT_EVERY_S", 0.0)
    drawn.clear()
    train(None, run_dir=run, resume=True, log=lambda _m: None, progress=False)
    assert drawn == [9, 12, 15, 18, 20]  # every checkpoint but the last, then once at the end


def test_refuses_to_overwrite_a_run(tmp_path):
    run = tmp_path / "run"
    spec = write_spec(tmp_path, max_steps=2, eval_interval=2)
    train(spec, run_dir=run, log=lambda _m: None, progress=False)
    with pytest.raises(LlmkitError, match="already holds a run"):
        train(spec, run_dir=run, log=lambda _m: None, progress=False)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    spec = write_spec(tmp_path, max_steps=4, eval_interval=2)
    train(spec, run_dir=run, log=lambda _m: None, progress=False)
    before = (run / "checkpoints" / "latest.json").read_text()
    weights = (Checkpoints(run).latest() / "model.safetensors").read_bytes()
    with pytest.raises(LlmkitError, match=r"non-finite (loss|gradient) at step [56]"):
        train(
            run_dir=run,
            resume=True,
            overrides=["train.max_steps=8", "optimizer.lr=1e30"],
            log=lambda _m: None,
            progress=False,
        )
    assert (run / "checkpoints" / "latest.json").read_text() == before
    assert (Checkpoints(run).latest() / "model.safetensors").read_bytes() == weights


def test_a_crash_during_a_save_leaves_latest_intact(tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(
        write_spec(tmp_path, max_steps=2, eval_interval=2),
        run_dir=run,
        log=lambda _m: None,
        progress=False,
    )
    ckpts = Checkpoints(run)
    good = ckpts.latest()

    def boom(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr("llmkit.runs.checkpoints.torch.save", boom)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(OSError):
        ckpts.save(3, model, {}, {})
    assert ckpts.latest() == good and (good / "state.pt").is_file()


@pytest.fixture
def trained(tmp_path: Path) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    run = tmp_path / "run"
    spec = write_spec(tmp_path, max_steps=4, eval_interval=2)
    train(spec, run_dir=run, log=lambda _m: None, progress=False)
    assert [p.name for p in Checkpoints(run).newest_first()] == ["step-000004", "step-000002"]
    return run


def _resume(run: Path, *overrides: str, log=lambda _m: None):
    return train(run_dir=run, resume=True, overrides=list(overrides), log=log, progress=False)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_resume_falls_back_from_a_damaged_checkpoint(trained, damage):
    weights = trained / "checkpoints" / "step-000004" / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        weights.unlink()
    with (trained / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 5, "lo')  # and a half-written metrics line
    logs: list[str] = []
    result = _resume(trained, "train.max_steps=6", log=logs.append)
    assert result.step == 6
    why = "unreadable weights" if damage == "truncated" else "no weights at"
    assert any(why in m and "resuming from step-000002" in m for m in logs)
    assert [m["step"] for m in read_metrics(trained) if "loss" in m] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.d_model=64", "weights do not match the model"),
        ('model.ffn={name="swiglu"}', "weights do not match the model"),
        ("optimizer.name=adafactor", "trained with optimizer 'adamw'"),
        ("train.max_steps=3", "at step 4 and train.max_steps is 3"),
    ],
)
def test_a_resume_that_cannot_continue_leaves_the_run_as_it_was(trained, override, message):
    spec = (trained / "spec.yaml").read_text()
    latest = (trained / "checkpoints" / "latest.json").read_text()
    with pytest.raises(LlmkitError, match=message):
        _resume(trained, "train.max_steps=6", override)
    assert (trained / "spec.yaml").read_text() == spec
    assert (trained / "checkpoints" / "latest.json").read_text() == latest
    assert _resume(trained, "train.max_steps=5").step == 5  # and it still resumes


def test_resume_after_a_kill_reproduces_the_uninterrupted_losses(tmp_path):
    spec = write_spec(tmp_path, max_steps=48, eval_interval=16, checkpoint_interval=8, batch_size=8)
    full, run, killed_at = train_killed_and_resumed(spec, tmp_path, kill_at=16)
    assert killed_at < 48
    assert losses(run) == losses(full)
    assert val_losses(run) == val_losses(full)
    assert len(losses(full)) == 48
    assert counts(run) == counts(full)  # tokens and trained tokens carried over exactly


def counts(run: Path) -> list[tuple[int, int, int]]:
    return [(m["step"], m["tokens"], m["trained_tokens"]) for m in read_metrics(run) if "loss" in m]


def test_cli_eval_and_generate(tmp_path):
    env = {**os.environ, "LLMKIT_PLUGINS": ""}

    def llmkit(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            cli(*args), env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
        )

    run = tmp_path / "run"
    spec = write_spec(tmp_path, max_steps=30, eval_interval=30, sample_tokens=20)
    proc = llmkit("train", str(spec), "--out", str(run), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "sample" in proc.stdout and "done: 30 steps" in proc.stdout
    # The done line leads with the validation cross-entropy; no objective beside it (the
    # cross-entropy is the objective), and sweeps still read its stop reason.
    from llmkit.experiments.trial import stop_reason

    (done,) = [line for line in proc.stdout.splitlines() if line.startswith("done: ")]
    val = [m for m in read_metrics(run) if "val_ce" in m][-1]
    found = re.search(r"\(max_steps\); val loss: ce ([\d.]+) \(ppl ([\d.]+)\); run: ", done)
    assert found, done
    assert float(found[1]) == pytest.approx(val["val_ce"], abs=1e-4)
    assert float(found[2]) == pytest.approx(val["val_ppl"], abs=0.01)
    assert "objective" not in done and "trained" not in done
    assert re.search(r"^step 30: val ce [\d.]+ \(ppl [\d.]+\) \(best\)$", proc.stdout, re.M)
    assert stop_reason(proc.stdout.splitlines()) == "max_steps"
    proc = llmkit("eval", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    assert "perplexity" in proc.stderr and "bits/byte" in proc.stderr
    assert json.loads(proc.stdout)["tokens"] > 0  # stdout is the JSON alone
    other = tmp_path / "other.txt"
    other.write_text("Speak, speak. All resolved.\n")
    proc = llmkit("eval", str(run), "--data", str(other))
    assert proc.returncode == 0 and "bits/byte" in proc.stdout, proc.stderr
    other.write_bytes(b"\xff\xfe\x00binary")
    proc = llmkit("eval", str(run), "--data", str(other))
    assert proc.returncode == 2 and "not UTF-8 text" in proc.stderr, proc.stderr
    proc = llmkit(
        "generate", str(run), "--prompt", "First", "--max-new-tokens", "15", "--seed", "1"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("First") and len(proc.stdout) > len("First")
    proc = llmkit("eval", str(tmp_path / "nope"))
    assert proc.returncode == 2 and "run not found" in proc.stderr
    assert "Traceback" not in proc.stderr


def _quiet(**kw):
    return {"log": lambda _m: None, "progress": False, **kw}


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    """2 micro-batches of 4 give the same first step as one batch of 8 (dropout off)."""
    runs = {}
    for name, sets in {
        "big": ["train.batch_size=8"],
        "accum": ["train.batch_size=4", "train.grad_accum=2"],
    }.items():
        spec = write_spec(tmp_path / name, max_steps=3, eval_interval=3)
        result = train(
            spec,
            run_dir=tmp_path / name / "run",
            overrides=[*sets, "model.dropout=0.0"],
            **_quiet(),
        )
        runs[name] = [m for m in result.history if "loss" in m]
    # the same 8 sequences reach the optimizer either way; sums differ only by rounding
    for a, b in zip(runs["big"], runs["accum"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)


def test_activation_checkpointing_gives_the_same_losses(tmp_path):
    losses = []
    for flag in (False, True):
        spec = write_spec(tmp_path / str(flag), max_steps=4, eval_interval=4)
        result = train(
            spec,
            run_dir=tmp_path / str(flag) / "run",
            overrides=[f"train.activation_checkpointing={str(flag).lower()}", "model.dropout=0.0"],
            **_quiet(),
        )
        losses.append([m["loss"] for m in result.history if "loss" in m])
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


def test_early_stopping_and_max_time(tmp_path):
    spec = write_spec(tmp_path, max_steps=200, eval_interval=2, early_stopping_patience=1)
    result = train(spec, run_dir=tmp_path / "es", overrides=["optimizer.lr=1e-9"], **_quiet())
    assert result.stopped == "early_stopping" and result.step < 200
    spec = write_spec(tmp_path / "t", max_steps=100000, eval_interval=1000)
    result = train(spec, run_dir=tmp_path / "t" / "run", max_time=2.0, **_quiet())
    assert result.stopped == "max_time" and result.step < 100000
    assert Checkpoints(tmp_path / "t" / "run").latest() is not None


def test_skip_mode_skips_non_finite_steps(tmp_path, monkeypatch):
    import llmkit.training as train_mod

    calls = {"n": 0}
    original = train_mod.Trainer._train_step

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 2:  # one step whose loss came out NaN (its update dropped)
            return StepResult(float("nan"), float("nan"), applied=False)
        return original(self)

    monkeypatch.setattr(train_mod.Trainer, "_train_step", flaky)
    spec = write_spec(tmp_path, max_steps=4, eval_interval=4, on_nonfinite="skip")
    result = train(spec, run_dir=tmp_path / "run", **_quiet())
    assert result.step == 4 and calls["n"] == 5


def _poison_training_calls(monkeypatch, *calls: int) -> dict[str, int]:
    """Make the objective's loss NaN on the given training forwards (1-based; evaluation's
    forwards, without gradients, are not counted). Returns the running count."""
    from llmkit.model.objective import Objective, ObjectiveOutput

    count = {"n": 0}
    real = Objective.__call__

    def poisoned(self, forward, x, y, **kw):
        out = real(self, forward, x, y, **kw)
        if not torch.is_grad_enabled():
            return out
        count["n"] += 1
        if count["n"] in calls:
            return ObjectiveOutput(out.loss * float("nan"), out.aux_losses, out.metrics)
        return out

    monkeypatch.setattr(Objective, "__call__", poisoned)
    return count


def test_the_trainer_reads_step_outcomes_only_at_its_check_points(tmp_path, monkeypatch):
    # The fused AdamW drops a non-finite step on the device, so the host reads the steps'
    # outcomes only at logged, evaluated and checkpointed steps: four at a time here.
    real = StepResult.read_all
    reads: list[int] = []

    def counting(results):
        results = list(results)
        reads.append(sum(not r.known for r in results))
        real(results)

    monkeypatch.setattr(StepResult, "read_all", staticmethod(counting))
    spec = write_spec(tmp_path, max_steps=12, eval_interval=12, log_interval=4)
    result = train(spec, run_dir=tmp_path / "run", **_quiet())
    assert result.step == 12 and reads == [4, 4, 4]
    assert [m["step"] for m in result.history if "loss" in m] == [4, 8, 12]


def test_skip_mode_redoes_a_step_dropped_on_the_device(tmp_path, monkeypatch):
    # Step 3's loss is NaN: its update is dropped on the device at once, the trainer learns
    # of it at step 4 (a logged step), and the step is taken again (skips do not count).
    count = _poison_training_calls(monkeypatch, 3)
    messages: list[str] = []
    spec = write_spec(tmp_path, max_steps=8, eval_interval=8, log_interval=4, on_nonfinite="skip")
    run = tmp_path / "run"
    result = train(spec, run_dir=run, log=messages.append, progress=False)
    assert result.step == 8 and count["n"] == 9
    assert "step 3: non-finite loss (nan), step skipped" in messages
    assert [m["step"] for m in result.history if "loss" in m] == [4, 8]
    assert result.history[1]["tokens"] == 8 * 4 * 32  # the skipped step's tokens not counted
    state = torch.load(Checkpoints(run).latest() / "state.pt", weights_only=True)
    steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert steps == {8.0}  # eight updates: the dropped one reverted its step count


def test_ten_skipped_steps_in_a_row_stop_the_run(tmp_path, monkeypatch):
    _poison_training_calls(monkeypatch, *range(2, 40))
    spec = write_spec(tmp_path, max_steps=30, eval_interval=30, log_interval=7, on_nonfinite="skip")
    with pytest.raises(LlmkitError, match="10 consecutive steps with a non-finite loss"):
        train(spec, run_dir=tmp_path / "run", **_quiet())


def test_a_non_finite_step_found_at_the_next_check_point_is_named(tmp_path, monkeypatch):
    # on_nonfinite = "stop": the update of step 2 is dropped on the device; the run stops at
    # step 5, the first logged step, naming step 2, and saves nothing.
    count = _poison_training_calls(monkeypatch, 2)
    run = tmp_path / "run"
    spec = write_spec(tmp_path, max_steps=10, eval_interval=10, log_interval=5)
    with pytest.raises(LlmkitError, match=r"non-finite loss at step 2 \(loss nan"):
        train(spec, run_dir=run, **_quiet())
    assert count["n"] == 5 and Checkpoints(run).latest() is None


@pytest.mark.parametrize("precision", ["bf16"])
def test_bf16_autocast_trains_on_cpu(tmp_path, precision):
    spec = write_spec(tmp_path, max_steps=3, eval_interval=3, precision=precision)
    result = train(spec, run_dir=tmp_path / "run", **_quiet())
    assert all(math.isfinite(m["loss"]) for m in result.history if "loss" in m)


@pytest.mark.parametrize("reuse", [True, False])
def test_the_trainer_reuses_freed_memory_on_a_cpu_unless_told_not_to(tmp_path, monkeypatch, reuse):
    from llmkit import hardware

    calls: list[bool] = []
    monkeypatch.setattr(hardware, "reuse_freed_memory", lambda: calls.append(True) or True)
    spec = write_spec(tmp_path, max_steps=2, eval_interval=2, reuse_freed_memory=reuse)
    train(spec, run_dir=tmp_path / "run", **_quiet())
    assert calls == ([True] if reuse else [])


def test_fp16_is_refused_on_cpu(tmp_path):
    spec = write_spec(tmp_path, max_steps=3, precision="fp16")
    with pytest.raises(LlmkitError, match="fp16 needs a CUDA GPU"):
        train(spec, run_dir=tmp_path / "run", **_quiet())


def test_a_validation_split_shorter_than_a_block_fails_before_training(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(LlmkitError, match="validation split: corpus shorter than one block"):
        train(
            write_spec(tmp_path),
            run_dir=run,
            overrides=["data.source.val_fraction=0.002"],  # ≈ 19 tokens < block_size + 1
            **_quiet(),
        )
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    # The same command, with the data fixed, starts again in that directory.
    result = train(write_spec(tmp_path, max_steps=2, eval_interval=2), run_dir=run, **_quiet())
    assert result.step == 2


def test_refuses_a_non_empty_directory_that_is_not_a_run(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "spec.yaml").write_text("my notes\n")
    with pytest.raises(LlmkitError, match="not an empty directory"):
        train(write_spec(tmp_path), run_dir=out, **_quiet())
    assert (out / "spec.yaml").read_text() == "my notes\n"
    with pytest.raises(LlmkitError, match="not an empty directory"):
        train(write_spec(tmp_path), run_dir=out / "spec.yaml", **_quiet())


def test_data_errors_are_clear(tmp_path):
    spec = write_spec(tmp_path, max_steps=3)
    with pytest.raises(LlmkitError, match="nope"):
        train(
            spec,
            run_dir=tmp_path / "run",
            overrides=[f'data.source.paths=["{tmp_path / "nope.txt"}"]'],
            **_quiet(),
        )


_NO_DYNAMO = """
import sys
from llmkit.cli.app import main

spec, run = sys.argv[1:]
steps = [
    ["train", spec, "--out", run, "--no-progress"],
    ["train", "--resume", run, "--max-steps", "25", "--no-progress"],
    ["eval", run],
    ["generate", run, "--prompt", "First", "--max-new-tokens", "8", "--seed", "1"],
]
for argv in steps:
    assert main(argv) == 0, argv
print("torch._dynamo" in sys.modules)
"""


def test_training_resuming_and_generating_never_import_dynamo(tmp_path):
    # torch.optim's wrappers and the meta-device check would import torch._dynamo (1–2 s of
    # every start); a run that compiles nothing must not pay for it.
    spec = write_spec(tmp_path, max_steps=20, eval_interval=10, checkpoint_interval=10)
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _NO_DYNAMO, str(spec), str(run)],
        cwd=ROOT,
        env={**os.environ, "LLMKIT_PLUGINS": ""},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("False"), proc.stdout
    assert len(losses(run)) == 25


def test_compiled_training_matches_eager_and_resumes(tmp_path):
    # train.compile = true runs the step through torch.compile (inductor, a C++ compiler on
    # the CPU): the same losses as eager without dropout, checkpoints of the plain model (no
    # ``_orig_mod.`` keys), and a compiled run resumes.
    from safetensors.torch import load_file
    from torch._dynamo.utils import counters

    spec = write_train_spec(tmp_path, CORPUS, max_steps=4, eval_interval=2)
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    train(spec, run_dir=eager, log=lambda _m: None, progress=False)
    torch._dynamo.reset()
    counters.clear()
    train(spec, run_dir=compiled, overrides=["train.compile=true"], log=lambda _m: None,
          progress=False)  # fmt: skip
    assert counters["stats"]["unique_graphs"] >= 1  # the step did go through dynamo
    (e_steps, e_loss), (c_steps, c_loss) = zip(*losses(eager)), zip(*losses(compiled))
    assert c_steps == e_steps and c_loss == pytest.approx(e_loss, rel=1e-4)
    e_w = load_file(Checkpoints(eager).latest() / "model.safetensors")
    c_w = load_file(Checkpoints(compiled).latest() / "model.safetensors")
    assert sorted(c_w) == sorted(e_w)
    for name, value in e_w.items():
        torch.testing.assert_close(c_w[name], value, rtol=1e-4, atol=1e-5)
    result = _resume(compiled, "train.max_steps=6")
    assert result.step == 6 and [s for s, _ in losses(compiled)][-2:] == [5, 6]
    torch._dynamo.reset()


def test_only_an_evaluated_checkpoint_is_marked_best(tmp_path, monkeypatch):
    # Checkpoints every 2 steps, evaluations every 4: the saves at steps 2 and 6 were never
    # evaluated, so best.json must never name them (nor prune the evaluated one for them).
    saves: list[tuple[int, bool]] = []
    real = Checkpoints.save

    def recording(self, step, *args, best=False, **kwargs):
        saves.append((step, best))
        return real(self, step, *args, best=best, **kwargs)

    monkeypatch.setattr(Checkpoints, "save", recording)
    run = tmp_path / "run"
    spec = write_spec(tmp_path, max_steps=8, eval_interval=4, checkpoint_interval=2)
    result = train(spec, run_dir=run, log=lambda _m: None, progress=False)
    assert [s for s, _ in saves] == [2, 4, 6, 8]
    assert not any(best for s, best in saves if s in (2, 6)) and saves[1] == (4, True)
    vals = dict(val_losses(run))
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["step"] in vals and vals[best["step"]] == pytest.approx(min(vals.values()))
    assert result.best_val_loss == pytest.approx(min(vals.values()))
    assert (run / "checkpoints" / best["dir"]).is_dir()
