"""Training on a mesh layout (``[train.parallel]`` table): real ``torchrun`` jobs on gloo.

Equality contract as in tests/training/test_distributed.py: with dropout 0 and the same
global batch, a layout's loss and validation curves equal one process's within 1e-4 (measured:
≤ 6e-5; fp32 summation order), for tensor (tp), context (cp) and pipeline (pp) parallelism,
with activation checkpointing on. A run resumes on another layout from its plain files (any
layout) or its DCP shards (a job of the same form, resharded), exactly: the run killed at a
step and resumed elsewhere equals the uninterrupted single-process run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.training.test_distributed import (
    TRAIN,
    assert_same,
    metrics,
    ok,
    run,
    single,
    torchrun,
    write_spec,
)

FAIL = {"LLMKIT_FAIL_AT": "0:11"}  # rank 0 raises before step 11: checkpoints 4 and 8 kept
CKPT = ("--set", "train.checkpoint_interval=4")
TP2 = ("--set", "train.parallel.tp=2")
AC = ("--set", "train.activation_checkpointing=true")  # exact: the curves do not change


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The spec and single-process runs with global batches of 4 and 8 sequences (×2
    accumulation steps)."""
    tmp = tmp_path_factory.mktemp("mesh")
    spec = write_spec(tmp, grad_accum=2)
    untied = yaml.safe_load(spec.read_text())  # pipeline stages hold the embedding and the
    untied["model"]["tie_embeddings"] = False  # head apart
    spec.write_text(yaml.safe_dump(untied))
    ok(single("train", str(spec), "--out", str(tmp / "b4"), *TRAIN))
    ok(single("train", str(spec), "--out", str(tmp / "b8"), *TRAIN, "--set", "train.batch_size=8"))
    return spec, tmp / "b4", tmp / "b8"


def _failed(proc) -> None:
    assert proc.returncode != 0 and "injected failure" in proc.stderr + proc.stdout


def test_tensor_parallel_matches_one_process_and_resumes_on_one(references, tmp_path):
    spec, b4, _ = references
    out = tmp_path / "tp"
    proc = run(torchrun("train", str(spec), "--out", str(out), *TRAIN, *TP2, *AC, *CKPT), **FAIL)
    _failed(proc)
    assert "distributed: mesh tp=2 on 2 processes (gloo); global batch 8 sequences" in proc.stdout
    train, _ = metrics(out)
    assert len(train) == 10
    assert_same(train, metrics(b4)[0][:10])
    resumed = ok(single("train", "--resume", str(out), *TRAIN, "--set", "train.parallel=auto"))
    assert "at step 8" in resumed.stdout
    assert_same(metrics(out)[0], metrics(b4)[0])
    assert_same(metrics(out)[1], metrics(b4)[1])


def test_tp_by_fsdp_on_four_ranks_matches_and_its_shards_reshard_onto_two(references, tmp_path):
    spec, _, b8 = references
    out = tmp_path / "tp-fsdp"
    layout = ("--set", "train.parallel.dp_shard=2", *TP2)
    proc = run(
        torchrun("train", str(spec), "--out", str(out), *TRAIN, *layout, *CKPT, nproc=4), **FAIL
    )
    _failed(proc)
    assert "distributed: mesh dp_shard=2 × tp=2 on 4 processes" in proc.stdout
    assert (out / "checkpoints" / "step-000008" / "dcp").is_dir()
    # tp=2 alone with the same global batch: the 2-D shards reshard onto the 1-D split
    again = ("--set", "train.parallel.dp_shard=1", "--set", "train.batch_size=8")
    trust = {"LLMKIT_TRUST_CHECKPOINTS": "1"}
    resumed = ok(torchrun("train", "--resume", str(out), *TRAIN, *TP2, *again), **trust)
    assert "(its dcp/ shards resharded onto tp=2)" in resumed.stdout
    assert_same(metrics(out)[0], metrics(b8)[0])
    assert_same(metrics(out)[1], metrics(b8)[1])


def test_context_parallelism_matches_one_process_and_resumes_split_by_tp(references, tmp_path):
    """cp = 2 trains the one-process curve; its checkpoint (plain files: shards of another
    form) resumes under tensor parallelism, each rank keeping its part of the whole weights."""
    spec, b4, _ = references
    out = tmp_path / "cp"
    cp2 = ("--set", "train.parallel.cp=2", *AC)  # recomputed blocks re-run the ring
    proc = run(torchrun("train", str(spec), "--out", str(out), *TRAIN, *cp2, *CKPT), **FAIL)
    _failed(proc)
    assert "distributed: mesh cp=2 on 2 processes (gloo); global batch 8 sequences" in proc.stdout
    train, _ = metrics(out)
    assert len(train) == 10
    assert_same(train, metrics(b4)[0][:10])
    resumed = ok(
        torchrun("train", "--resume", str(out), *TRAIN, "--set", "train.parallel.cp=1", *TP2)
    )
    assert "at step 8" in resumed.stdout and "(its whole weights split onto tp=2)" in resumed.stdout
    assert_same(metrics(out)[0], metrics(b4)[0])
    assert_same(metrics(out)[1], metrics(b4)[1])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            ("model.n_heads=1", "train.parallel.tp=2"),
            "train.parallel.tp = 2 does not divide model.n_heads = 1",
        ),
        (
            ("model.position.name=alibi", "train.parallel.cp=2"),
            "position 'alibi' (layer 0) biases the attention scores",
        ),
    ],
)
def test_a_bad_layout_is_one_line_before_any_model(references, tmp_path, settings, message):
    spec = references[0]
    sets = [a for s in settings for a in ("--set", s)]
    proc = run(torchrun("train", str(spec), "--out", str(tmp_path / "r"), *TRAIN, *sets))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: [rank 0]")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split("error: [rank")[0]
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_pipeline_parallelism_matches_one_process_and_resumes_on_one(references, tmp_path):
    """pp = 2 (1F1B, 2 micro-batches) trains the one-process curve; killed at step 11, its
    plain checkpoint files — every stage's weights and optimizer state gathered to rank 0 —
    resume on one process exactly, and its DCP shards on FSDP ranks. Its blocks are
    compiled (train.compile under a pipeline compiles each stage's blocks in place)."""
    spec, b4, _ = references
    out = tmp_path / "pp"
    pp2 = ("--set", "train.parallel.pp=2", *AC, "--set", "train.compile=true")  # per block
    proc = run(torchrun("train", str(spec), "--out", str(out), *TRAIN, *pp2, *CKPT), **FAIL)
    _failed(proc)
    assert "distributed: mesh pp=2 (pipeline 1f1b, 2 micro-batches" in proc.stdout
    train, val = metrics(out)
    assert len(train) == 10 and len(val) == 1
    assert_same(train, metrics(b4)[0][:10])
    copy = tmp_path / "pp-shards"
    shutil.copytree(out, copy)
    eager = ("--set", "train.compile=false")  # the resumes: compiling is checked above
    resumed = ok(
        single("train", "--resume", str(out), *TRAIN, *eager, "--set", "train.parallel=auto")
    )
    assert "at step 8" in resumed.stdout
    assert_same(metrics(out)[0], metrics(b4)[0])
    assert_same(metrics(out)[1], metrics(b4)[1])
    # its DCP shards (every stage's, named as one process names them) reshard onto FSDP
    dp2 = ("--set", "train.parallel.pp=1", "--set", "train.parallel.dp_shard=2")
    again = (*dp2, *eager, "--set", "train.batch_size=2")  # the same global batch: rows
    trust = {"LLMKIT_TRUST_CHECKPOINTS": "1"}
    resumed = ok(torchrun("train", "--resume", str(copy), *TRAIN, *again), **trust)
    assert "(its dcp/ shards resharded onto dp_shard=2)" in resumed.stdout
    assert_same(metrics(copy)[0], metrics(b4)[0])


def test_pipeline_stages_by_fsdp_resume_on_hsdp_by_context_parallelism(references, tmp_path):
    """pp = 2 × dp_shard = 2 (FSDP per stage; 4 processes) killed at step 11 resumes on
    dp_replicate = 2 × cp = 2 (HSDP over the flattened dp_shard × cp ranks) from its plain
    files: with the same global batch, the whole run equals one process's."""
    spec, _, b8 = references
    out = tmp_path / "pp-fsdp"
    first = ("--set", "train.parallel.pp=2", "--set", "train.parallel.dp_shard=2")
    proc = run(
        torchrun("train", str(spec), "--out", str(out), *TRAIN, *first, *CKPT, nproc=4), **FAIL
    )
    _failed(proc)
    assert "distributed: mesh pp=2 × dp_shard=2 (pipeline 1f1b" in proc.stdout
    assert_same(metrics(out)[0], metrics(b8)[0][:10])
    second = ("--set", "train.parallel.pp=1", "--set", "train.parallel.dp_shard=1")
    second += ("--set", "train.parallel.dp_replicate=2", "--set", "train.parallel.cp=2")
    resumed = ok(torchrun("train", "--resume", str(out), *TRAIN, *second, nproc=4))
    assert "(its whole weights split onto dp_replicate=2 × cp=2)" in resumed.stdout
    assert_same(metrics(out)[0], metrics(b8)[0])
    assert_same(metrics(out)[1], metrics(b8)[1])


def test_a_one_process_run_resumes_on_pipeline_stages_split_by_tp(references, tmp_path):
    """The other way, composed: a one-process checkpoint (optimizer state numbered, not
    named) resumes on pp = 2 × tp = 2 under GPipe (4 processes), each stage keeping its part
    and splitting it by tensor parallelism (sequence-parallel hidden states between stages,
    the vocabulary-parallel loss on the last)."""
    spec, b4, _ = references
    out = tmp_path / "one"
    _failed(run(single("train", str(spec), "--out", str(out), *TRAIN, *CKPT), **FAIL))
    gpipe = ("--set", "train.parallel.pp=2", "--set", "train.parallel.schedule=gpipe", *TP2)
    resumed = ok(torchrun("train", "--resume", str(out), *TRAIN, *gpipe, nproc=4))
    assert "(its whole weights split onto pp=2 × tp=2" in resumed.stdout
    assert_same(metrics(out)[0], metrics(b4)[0])
    assert_same(metrics(out)[1], metrics(b4)[1])
