"""Multi-process training: real ``torchrun`` jobs of 2 processes on the gloo backend.

Equality contract: with dropout 0, an N-rank job with per-rank batch b reads, every step,
exactly the blocks one process reads with batch N·b (lockstep sharding), and gradients are
averaged, so losses match a single-process run up to float summation order. Tolerance:
1e-4 absolute on losses rounded to 6 decimals (measured differences: 0 to ~1e-6).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llmkit.errors import LlmkitError
from llmkit.training import distributed
from llmkit.training.strategy import ParallelStrategy
from tests.helpers import write_train_spec

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "hex"]


def write_spec(tmp_path: Path, **train) -> Path:
    """No dropout (ranks draw different dropout masks); 16 steps, evaluation at 8 and 16."""
    import random

    rng = random.Random(0)
    corpus = "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(3000))
    defaults = {"max_steps": 16, "eval_interval": 8, "eval_batches": 3}
    return write_train_spec(tmp_path, corpus, **{**defaults, **train})


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "LLMKIT_PLUGINS": "", "OMP_NUM_THREADS": "1", **extra}


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "llmkit.cli",
        *args,
    ]


def single(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmkit.cli", *args]


def run(cmd: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, env=_env(**env), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def ok(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    proc = run(cmd, **env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def metrics(run_dir: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [(m["step"], m["loss"]) for m in lines if "loss" in m]
    val = [(m["step"], m["val_loss"]) for m in lines if "val_loss" in m]
    return train, val


def assert_same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> None:
    assert [s for s, _ in a] == [s for s, _ in b]
    worst = max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True))
    assert worst <= TOL, (worst, a, b)


TRAIN = ("--no-progress", "--no-sample")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A single-process run with the global batch (8 sequences, 2 accumulation steps)."""
    tmp = tmp_path_factory.mktemp("reference")
    spec = write_spec(tmp, grad_accum=2)
    ok(single("train", str(spec), "--out", str(tmp / "run"), *TRAIN, "--set", "train.batch_size=8"))
    return spec, tmp / "run"


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_match_one_process_with_the_global_batch(reference, tmp_path, parallel):
    spec, ref = reference
    out = tmp_path / parallel
    proc = ok(
        torchrun(
            "train", str(spec), "--out", str(out), *TRAIN, "--set", f"train.parallel={parallel}"
        )
    )
    train, val = metrics(out)
    ref_train, ref_val = metrics(ref)
    assert len(train) == 16 and len(val) == 2
    assert_same(train, ref_train)
    assert_same(val, ref_val)
    # One report for the job: rank 0 prints, logs and plots.
    assert proc.stdout.count("done: 16 steps") == 1
    assert f"distributed: {parallel} on 2 processes (gloo)" in proc.stdout
    assert (out / "loss.png").is_file()
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len({line for line in lines})  # nothing written twice
    ckpt = json.loads((out / "checkpoints" / "latest.json").read_text())
    step_dir = out / "checkpoints" / ckpt["dir"]
    assert (step_dir / "rank-00000.pt").is_file() and (step_dir / "rank-00001.pt").is_file()
    assert (step_dir / "dcp").is_dir() == (parallel == "fsdp")
    # The exported weights are one plain safetensors file for one device.
    gen = ok(
        single(
            "generate", str(out), "--prompt", "the ", "--max-new-tokens", "8", "--temperature", "0"
        )
    )
    assert gen.stdout.startswith("the ")  # sampled unseeded: the tokens may be blanks
    ev = json.loads(ok(single("eval", str(out), "--json")).stdout)
    ref_ev = json.loads(ok(single("eval", str(ref), "--json")).stdout)
    assert abs(ev["loss"] - ref_ev["loss"]) <= TOL


def _kill_after(cmd: list[str], run_dir: Path, step: int) -> int:
    """Start ``cmd`` in its own process group, SIGKILL the whole group (launcher and every
    rank) once checkpoint ``step`` or later is the latest; the step killed at."""
    proc = subprocess.Popen(
        cmd,
        env=_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    pointer = run_dir / "checkpoints" / "latest.json"
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            if pointer.is_file() and json.loads(pointer.read_text())["step"] >= step:
                break
            assert proc.poll() is None, "training ended before it could be killed"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return json.loads(pointer.read_text())["step"]


def test_resume_after_killing_the_job(reference, tmp_path):
    """FSDP killed mid-run resumes exactly (a DDP job resumes in
    test_ranks_agree_on_the_checkpoint_when_only_one_cannot_read_it)."""
    parallel = "fsdp"
    spec, ref = reference
    out = tmp_path / "killed"
    setting = f"train.parallel={parallel}"
    killed_at = _kill_after(
        torchrun(
            "train",
            str(spec),
            "--out",
            str(out),
            *TRAIN,
            "--set",
            setting,
            "--set",
            "train.checkpoint_interval=2",
        ),
        out,
        4,
    )
    assert 4 <= killed_at < 16
    # reading shards unpickles their metadata: only when asked
    proc = run(torchrun("train", "--resume", str(out), *TRAIN))
    assert proc.returncode != 0 and "LLMKIT_TRUST_CHECKPOINTS=1" in proc.stderr
    ok(torchrun("train", "--resume", str(out), *TRAIN), LLMKIT_TRUST_CHECKPOINTS="1")
    train, val = metrics(out)
    ref_train, ref_val = metrics(ref)
    assert_same(train, ref_train)
    assert_same(val, ref_val)


def test_ranks_agree_on_the_checkpoint_when_only_one_cannot_read_it(reference, tmp_path):
    """Rank 1's own file of the latest checkpoint is damaged: both ranks resume from the older
    checkpoint (a rank resuming alone from another step would hang the job), and the
    resumed run still matches the uninterrupted reference."""
    spec, ref = reference
    out = tmp_path / "ddp"
    setting = "train.checkpoint_interval=4"
    ok(torchrun("train", str(spec), "--out", str(out), *TRAIN, "--set", setting))
    (out / "checkpoints" / "step-000016" / "rank-00001.pt").write_bytes(b"not a torch file")
    proc = ok(torchrun("train", "--resume", str(out), *TRAIN))
    assert "cannot be read on 1 other rank(s); resuming from step-000012" in proc.stdout
    train, val = metrics(out)
    ref_train, ref_val = metrics(ref)
    assert_same(train, ref_train)
    assert_same(val, ref_val)


def test_fsdp_checkpoint_resumes_on_another_number_of_ranks(reference, tmp_path):
    """Saved by 2 FSDP ranks (sharded), resumed by 1 process with the same global batch."""
    spec, ref = reference
    out = tmp_path / "resharded"
    ok(
        torchrun(
            "train",
            str(spec),
            "--out",
            str(out),
            *TRAIN,
            "--set",
            "train.parallel=fsdp",
            "--set",
            "train.max_steps=16",
            "--set",
            "train.checkpoint_interval=4",
        )
    )
    latest = out / "checkpoints" / "latest.json"
    # Roll the run back to its step-12 checkpoint, then finish on a single process.
    data = json.loads(latest.read_text())
    assert data["step"] == 16
    assert (out / "checkpoints" / "step-000012" / "dcp").is_dir()
    latest.write_text(json.dumps({**data, "step": 12, "dir": "step-000012"}))
    ok(single("train", "--resume", str(out), *TRAIN, "--set", "train.batch_size=8"))
    train, _ = metrics(out)
    ref_train, _ = metrics(ref)
    assert_same(train, ref_train)


def test_a_crashing_rank_fails_the_job_with_its_error(tmp_path):
    spec = write_spec(tmp_path)
    start = time.time()
    proc = run(
        torchrun("train", str(spec), "--out", str(tmp_path / "run"), *TRAIN),
        timeout=240,
        LLMKIT_FAIL_AT="1:3",
    )
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "injected failure on rank 1" in output
    assert time.time() - start < 200  # the surviving rank did not wait out the 600 s timeout


def test_a_bad_spec_under_torchrun_is_one_line_per_rank(tmp_path):
    spec = write_spec(tmp_path)
    proc = run(
        torchrun(
            "train", str(spec), "--out", str(tmp_path / "r"), *TRAIN, "--set", "train.parallel=none"
        )
    )
    assert proc.returncode != 0
    assert "error: [rank 0] train.parallel is 'none'" in proc.stderr
    assert str(ROOT / "llmkit") not in proc.stderr  # no traceback through our code


# -- the single-process side of the context ----------------------------------------------------


def test_single_process_context(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = distributed.setup("fsdp", "cpu", 60)
    assert not ctx.distributed and ctx.is_main and ctx.parallel == "none"
    assert ctx.mean([torch.tensor(2.0), 3.0]) == [2.0, 3.0]
    assert ctx.sum([1.5, 2.0]) == [1.5, 2.0]
    assert ctx.broadcast({"a": 1}) == {"a": 1}
    distributed.exit_process(0)  # returns: no process group here


def test_single_process_strategy(monkeypatch):
    """fsdp asked for on one process trains plainly: nothing is wrapped, sharded or synced."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    strategy = ParallelStrategy.setup("fsdp", "cpu", 60)
    assert strategy.mode == "single" and not strategy.distributed and not strategy.sharded
    assert strategy.is_main and strategy.describe(4, 2) is None
    model = torch.nn.Linear(2, 2)
    assert strategy.wrap(model, None, "fp32") is model
    with strategy.grad_sync(model, False):
        pass
    assert strategy.full_model(model, lambda: None) is model
    assert strategy.any([True, False]) == [True, False]
    strategy.check_precision("fp16")  # only a sharded job refuses fp16
    x = torch.arange(6).view(3, 2)
    counted, padding = strategy.eval_shares([(x, x), (x[:0], x[:0])])
    assert len(counted) == 1 and padding == []


def test_strategy_modes_as_the_ranks_see_them():
    rank1 = ParallelStrategy(distributed.DistContext(rank=1, world_size=2, parallel="fsdp"))
    assert rank1.mode == "fsdp" and rank1.sharded and not rank1.is_main
    with pytest.raises(LlmkitError, match="fp16 is not supported with fsdp"):
        rank1.check_precision("fp16")
    logs: list[str] = []
    rank1.quiet_unless_main(logs.append)("not shown")
    assert logs == []
    x = torch.arange(3).view(3, 1)  # three rows over two ranks; a one-row batch leaves rank 1
    counted, padding = rank1.eval_shares([(x, x), (x[:1], x[:1])])
    assert [len(b[0]) for b in counted] == [1] and len(padding) == 1
    ddp = ParallelStrategy(distributed.DistContext(world_size=2, parallel="ddp"))
    assert ddp.mode == "ddp" and ddp.distributed and not ddp.sharded
    ddp.check_precision("fp16")


def test_launcher_environment_is_checked(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(LlmkitError, match="WORLD_SIZE"):
        distributed.launched_world_size()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LlmkitError, match=r"train\.parallel is 'none'"):
        distributed.setup("none", "cpu", 60)


def test_accumulation_all_reduces_only_on_the_last_micro_step(tmp_path):
    """DDP (a real 1-process gloo group) counts its gradient all-reduces through a comm
    hook: three micro-steps under ``grad_sync`` give one round of bucket reductions."""
    import torch.distributed as td
    from torch.nn.parallel import DistributedDataParallel

    store = td.FileStore(str(tmp_path / "store"), 1)
    td.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.Linear(4, 4))
        calls = []

        def hook(state, bucket):
            calls.append(bucket.index())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, hook)
        ctx = distributed.DistContext(world_size=2, parallel="ddp")  # as a 2-rank job sees it
        strategy = ParallelStrategy(ctx)
        for micro in range(3):
            with strategy.grad_sync(model, sync=micro == 2):
                model(torch.randn(2, 4)).sum().backward()
            assert len(calls) == (1 if micro == 2 else 0)
    finally:
        td.destroy_process_group()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_job_with_adapters_matches_one_process(reference, tmp_path, parallel):
    """LoRA under DDP and FSDP, started from trained weights (train.init_from: every rank
    loads the source before wrapping): frozen base, adapters averaged across ranks like any
    gradient, the job's losses those of one process with the global batch, and the saved
    adapters load on one process."""
    spec, ref = reference
    common = (
        "--init-from",
        str(ref),
        "--max-steps",
        "4",
        *TRAIN,
        "--set",
        "model.adapter.name=lora",
        "--set",
        "model.adapter.rank=4",
    )
    one = tmp_path / "one"
    ok(single("train", str(spec), "--out", str(one), *common, "--set", "train.batch_size=8"))
    job = tmp_path / parallel
    ok(
        torchrun(
            "train", str(spec), "--out", str(job), *common, "--set", f"train.parallel={parallel}"
        )
    )
    assert_same(metrics(job)[0], metrics(one)[0])
    assert metrics(job)[0][0][1] < metrics(ref)[0][0][1] - 0.3  # from the trained weights
    ev = json.loads(ok(single("eval", str(job), "--json")).stdout)
    ev_one = json.loads(ok(single("eval", str(one), "--json")).stdout)
    assert abs(ev["loss"] - ev_one["loss"]) <= TOL
    gen = ok(single("generate", str(job), "--prompt", "the ", "--max-new-tokens", "4"))
    assert gen.stdout.startswith("the ")  # sampled unseeded: the tokens may be blanks
