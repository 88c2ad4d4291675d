"""Data at scale under ``torchrun`` (2 processes, gloo): every rank reads disjoint rows from a
mixture of a streamed text source and a sharded token store, and a job killed mid-run resumes
exactly (the losses of the uninterrupted job): mixtures, stores and streams in one job."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from llmkit.training.batches import TRACE_ENV
from tests.helpers import write_train_spec
from tests.training.test_distributed import TRAIN, _kill_after, metrics, ok, single, torchrun

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "hex"]
STEPS = 12


def _corpus(seed: int, words: list[str]) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(1500))


def mixture_spec(tmp_path: Path) -> Path:
    """A streamed char-level text source (``data.streaming``: one DataLoader worker a rank)
    and a token store (``llmkit data prepare``, 4 shards) mixed 0.75 / 0.25, both in the
    store's tokenizer."""
    path = write_train_spec(
        tmp_path,
        _corpus(0, WORDS),
        max_steps=STEPS,
        eval_interval=6,
        eval_batches=2,
        checkpoint_interval=3,
    )
    other = tmp_path / "other.txt"
    other.write_text(_corpus(1, [w[::-1] for w in WORDS]))  # the same characters
    spec = yaml.safe_load(path.read_text())
    one = tmp_path / "one.yaml"
    one.write_text(
        yaml.safe_dump(
            {
                **spec,
                "data": {"source": {"name": "text", "paths": [str(other)], "val_fraction": 0.1}},
            }
        )
    )
    store = tmp_path / "store"
    ok(
        single(
            "data",
            "prepare",
            str(one),
            "--out",
            str(store),
            "--workers",
            "1",
            "--shard-tokens",
            "20000",
        )
    )
    first = spec["data"].pop("source")
    spec["tokenizer"] = {"kind": "char", "path": str(store / "tokenizer.json")}
    spec["data"].update(streaming=True, stream_workers=1)
    spec["data"]["mixture"] = [
        {"name": "lower", "source": first, "weight": 3},
        {"name": "store", "source": {"name": "tokens", "path": str(store)}, "weight": 1},
    ]
    path.write_text(yaml.safe_dump(spec))
    return path


def _rows(trace: Path, rank: int) -> list[str]:
    lines = (trace / f"rank-{rank}.jsonl").read_text().splitlines()
    return [row for line in lines for row in json.loads(line)["rows"]]


@pytest.fixture(scope="module")
def mixture_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """An uninterrupted 2-rank mixture job, its rows traced per rank."""
    tmp = tmp_path_factory.mktemp("mixture")
    spec = mixture_spec(tmp)
    out, trace = tmp / "run", tmp / "trace"
    ok(torchrun("train", str(spec), "--out", str(out), *TRAIN), **{TRACE_ENV: str(trace)})
    return spec, out, trace


def test_ranks_read_disjoint_rows_of_a_mixture(mixture_job):
    _, out, trace = mixture_job
    rank0, rank1 = _rows(trace, 0), _rows(trace, 1)
    batch = 4  # write_train_spec's batch_size, per rank
    assert len(rank0) == len(rank1) == STEPS * batch
    assert not set(rank0) & set(rank1)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in records if "share/lower" in m][-1]
    assert last["share/lower"] == pytest.approx(0.75, abs=0.01)
    assert "val_ce/store" in last


def test_a_killed_mixture_job_resumes_exactly(mixture_job, tmp_path):
    spec, full, _ = mixture_job
    out = tmp_path / "run"
    killed_at = _kill_after(torchrun("train", str(spec), "--out", str(out), *TRAIN), out, 3)
    assert killed_at < STEPS
    ok(torchrun("train", str(out), "--resume", *TRAIN))
    assert metrics(out) == metrics(full)


def stream_spec(tmp_path: Path, workers: int) -> Path:
    """A char-level spec streaming 4 JSONL files (read by ranks × workers readers)."""
    path = write_train_spec(
        tmp_path,
        "unused",
        max_steps=STEPS,
        eval_interval=6,
        eval_batches=2,
        checkpoint_interval=3,
    )
    rng = random.Random(2)
    files = []
    for i in range(4):
        f = tmp_path / f"part-{i}.jsonl"
        f.write_text(
            "".join(
                json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))})
                + "\n"
                for _ in range(400)
            )
        )
        files.append(str(f))
    spec = yaml.safe_load(path.read_text())
    spec["data"] = {
        "source": {"name": "jsonl", "paths": files, "val_fraction": 0.05},
        "streaming": True,
        "stream_workers": workers,
    }
    path.write_text(yaml.safe_dump(spec))
    return path
