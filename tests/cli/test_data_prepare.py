"""``llmkit data prepare``: the same store whatever the number of workers, finished after a
``kill -9`` with the same bytes, refusing to mix corpora or tokenizers; and a tiny model
trained from the store (and from llm.c files) through ``llmkit.training``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from llmkit.cli import main
from llmkit.data import shards_encode
from llmkit.data.llmc import write_llmc
from llmkit.data.shards_write import FAIL_ENV
from llmkit.data.tokenizer import Tokenizer, train_char
from llmkit.errors import LlmkitError
from llmkit.training import train
from tests.conftest import ROOT
from tests.data.test_shards import corpus


def fails(argv: list[str], capsys) -> str:
    """The one-line error ``llmkit ARGV`` exits 2 with."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ")
    return err[-1]


def files_of(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.iterdir()) if p.name != ".lock"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("prepare")
    docs = corpus(300, seed=1)
    path = tmp / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    tok = tmp / "tokenizer.json"
    train_char(docs).save(tok)
    other = tmp / "other.json"
    train_char([*docs, "XYZ"]).save(other)
    return {"docs": path, "tok": tok, "other": other, "tmp": tmp}


def args(inputs: dict[str, Path], out: Path, *more: str) -> list[str]:
    return [
        "data", "prepare", str(inputs["docs"]), "--out", str(out), "--tokenizer",
        str(inputs["tok"]), "--text-field", "body", "--shard-tokens", "1500", "--no-progress",
        *more,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def clean(inputs) -> Path:
    out = inputs["tmp"] / "clean"
    assert main(args(inputs, out, "--workers", "1")) == 0
    return out


def test_the_store_is_the_same_with_one_or_two_workers(inputs, clean, monkeypatch, capsys):
    index = json.loads((clean / "index.json").read_text())
    assert index["complete"] and len(index["splits"]["train"]["shards"]) >= 4
    assert index["splits"]["validation"]["tokens"] > 0
    monkeypatch.setattr(shards_encode, "PIECE_DOCS", 16)  # many pieces, dealt to two workers
    few = inputs["tmp"] / "pieces-1"
    two = inputs["tmp"] / "pieces-2"
    assert main(args(inputs, few, "--workers", "1")) == 0
    assert main(args(inputs, two, "--workers", "2")) == 0
    assert files_of(few) == files_of(two)
    ids = {n: b for n, b in files_of(clean).items() if n.endswith(".bin")}
    assert ids == {n: b for n, b in files_of(two).items() if n.endswith(".bin")}
    assert "2 worker(s)" in capsys.readouterr().out


def test_killed_mid_shard_then_rerun_finishes_with_the_same_bytes(inputs, clean, capsys):
    out = inputs["tmp"] / "killed"
    env = {**os.environ, FAIL_ENV: "2", "LLMKIT_PLUGINS": ""}
    cmd = [sys.executable, "-m", "llmkit.cli", *args(inputs, out, "--workers", "1")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    index = json.loads((out / "index.json").read_text())
    assert not index["complete"] and len(index["splits"]["train"]["shards"]) == 2
    assert list(out.glob(".*.tmp"))  # the third shard, half written
    assert main(args(inputs, out, "--workers", "1")) == 0
    assert not list(out.glob(".*.tmp"))
    assert files_of(out) == files_of(clean)
    capsys.readouterr()
    assert main(args(inputs, out)) == 0  # complete: every shard checked, nothing written
    assert "complete already" in capsys.readouterr().out
    assert files_of(out) == files_of(clean)


def test_a_lost_shard_is_written_again_and_a_corrupt_one_is_refused(inputs, clean, capsys):
    out = inputs["tmp"] / "damaged"
    assert main(args(inputs, out, "--workers", "1")) == 0
    (out / "train-000002.bin").unlink()
    assert main(args(inputs, out, "--workers", "1")) == 0
    assert files_of(out) == files_of(clean)
    data = bytearray((out / "train-000001.bin").read_bytes())
    data[7] ^= 0xFF
    (out / "train-000001.bin").write_bytes(bytes(data))
    assert re.search(
        r"train-000001\.bin: checksum does not match", fails(args(inputs, out), capsys)
    )


def test_another_tokenizer_or_corpus_is_refused_in_one_line(inputs, clean, tmp_path, capsys):
    before = files_of(clean)
    other = [a if a != str(inputs["tok"]) else str(inputs["other"]) for a in args(inputs, clean)]
    assert "prepared from another tokenizer recipe" in fails(other, capsys)
    more = tmp_path / "more.jsonl"
    more.write_text(inputs["docs"].read_text() + json.dumps({"body": "one more"}) + "\n")
    moved = [a if a != str(inputs["docs"]) else str(more) for a in args(inputs, clean)]
    assert "prepared from another source" in fails(moved, capsys)
    assert files_of(clean) == before  # nothing prepared is lost
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert "not empty and holds no index.json" in fails(args(inputs, tmp_path / "busy"), capsys)


# -- training from a store -------------------------------------------------------------------


def spec(tmp: Path, source: dict, name: str, **tokenizer) -> Path:
    data = {
        "name": name,
        "model": {"vocab_size": 512, "d_model": 32, "n_layers": 2, "n_heads": 2,
                  "max_seq_len": 32, "position": {"name": "rope"}},
        "tokenizer": {"kind": "char", **tokenizer},
        "data": {"source": source},
        "optimizer": {"name": "adamw", "lr": 3e-3},
        "train": {"batch_size": 4, "max_steps": 4, "eval_interval": 2, "eval_batches": 2,
                  "log_interval": 1, "precision": "fp32", "sample_tokens": 0},
    }  # fmt: skip
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_spec_prepares_a_store_that_a_run_trains_from(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(corpus(200, seed=2)))
    source = {"name": "text", "paths": [str(text)], "val_fraction": 0.1}
    store = tmp_path / "store"
    cmd = ["data", "prepare", str(spec(tmp_path, source, "prep")), "--out", str(store)]
    assert main([*cmd, "--shard-tokens", "700", "--workers", "1", "--no-progress"]) == 0
    assert "tokenizer sha256" in capsys.readouterr().out
    run = tmp_path / "run"
    result = train(
        spec(tmp_path, {"name": "tokens", "path": str(store)}, "fit"),
        run_dir=run,
        log=lambda _m: None,
        progress=False,
    )
    assert result.step == 4 and result.val_ce is not None
    assert (run / "tokenizer.json").read_bytes() == (store / "tokenizer.json").read_bytes()
    other = tmp_path / "other.json"
    train_char(["completely different"]).save(other)
    bad = spec(tmp_path, {"name": "tokens", "path": str(store)}, "bad", path=str(other))
    with pytest.raises(LlmkitError, match=r"is not the tokenizer of the token store") as err:
        train(bad, run_dir=tmp_path / "bad", log=lambda _m: None, progress=False)
    assert "\n" not in str(err.value)


def test_a_run_trains_from_llmc_files_with_their_tokenizer(tmp_path):
    docs = corpus(80, seed=3)
    tok = train_char(docs)
    tok.save(tmp_path / "tok.json")
    tok = Tokenizer.load(tmp_path / "tok.json")
    ids = np.concatenate([[tok.eos_id, *tok.encode(d)] for d in docs])
    cut = len(ids) * 9 // 10
    write_llmc(tmp_path / "toy_train_000001.bin", ids[: cut // 2])
    write_llmc(tmp_path / "toy_train_000002.bin", ids[cut // 2 : cut])
    write_llmc(tmp_path / "toy_val_000000.bin", ids[cut:])
    source = {
        "name": "tokens",
        "paths": [str(tmp_path / "toy_train_*.bin")],
        "val_paths": [str(tmp_path / "toy_val_*.bin")],
    }
    with pytest.raises(LlmkitError, match=r"set tokenizer\.path to the tokenizer\.json"):
        train(spec(tmp_path, source, "none"), run_dir=tmp_path / "r0", log=lambda _m: None)
    fit = spec(tmp_path, source, "bins", path=str(tmp_path / "tok.json"))
    result = train(fit, run_dir=tmp_path / "r1", log=lambda _m: None, progress=False)
    assert result.step == 4 and result.val_ce is not None
