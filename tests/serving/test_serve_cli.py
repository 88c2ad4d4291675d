"""``llmkit serve`` as users run it: a real process that SIGTERM drains (the request in
flight completes, new connections are refused, exit 0); a Hugging Face directory served as a
run is; bad arguments are one line and a non-zero exit."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from llmkit import cli
from llmkit.data.tokenizer import train_char
from llmkit.inference import Generator
from llmkit.model import build_model
from llmkit.runs import TOKENIZER_FILE, save_spec
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.serving import Engine
from llmkit.serving.loading import load_served
from llmkit.serving.server import ServerThread
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny tensors: one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run with random weights, big enough that 400 tokens take a second or so."""
    tok = train_char(["the quick brown fox jumps over the lazy dog.\n" * 3])
    path = tmp_path_factory.mktemp("serve-run")
    spec = tiny_spec(
        vocab_size=tok.vocab_size,
        position={"name": "rope"},
        max_seq_len=512,
        d_model=128,
        n_layers=4,
        n_heads=4,
    )
    spec["tokenizer"] = {"kind": "char"}
    rs = load_spec_dict(spec)
    torch.manual_seed(0)
    save_spec(rs, path)
    save_weights(build_model(rs), path / WEIGHTS)
    tok.save(path / TOKENIZER_FILE)
    return path


def _start(run_dir: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmkit.cli",
            "serve",
            str(run_dir),
            "--port",
            "0",
            "--threads",
            "1",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    url = None
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        found = re.search(r"on (http://[\d.]+:\d+)/v1", line)
        if found:
            url = found.group(1)
        if url and "startup complete" in line:
            break
    if url is None:
        proc.kill()
        raise AssertionError("the server did not start: " + "".join(lines))
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
    return proc, url


def test_sigterm_drains_the_request_in_flight_then_exits(run_dir: Path) -> None:
    proc, url = _start(run_dir)
    try:
        chunks: list[dict] = []
        first = threading.Event()
        done: dict[str, float] = {}

        def stream() -> None:
            body = {
                "model": run_dir.name,
                "prompt": "the",
                "max_tokens": 400,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done["at"] = time.monotonic()
                    elif line.startswith("data: "):
                        chunks.append(json.loads(line[6:]))
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        refused_at = None
        deadline = time.monotonic() + 30
        while refused_at is None and time.monotonic() < deadline:
            try:
                httpx.get(f"{url}/health", timeout=1)
                time.sleep(0.02)
            except httpx.TransportError:
                refused_at = time.monotonic()
        reader.join(120)
        assert refused_at is not None, "new connections were still accepted"
        assert "at" in done and refused_at < done["at"]  # draining while the stream ran
        assert len(chunks) == 400 and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_hugging_face_directory_is_served_as_its_run(run_dir: Path, tmp_path: Path) -> None:
    from llmkit.interop.runs import export_hf

    hf = tmp_path / "tiny-hf"
    export_hf(run_dir, hf)
    served = load_served(hf)
    assert served.name == "tiny-hf"
    ref = Generator(str(run_dir)).generate(
        "the lazy", temperature=0, max_new_tokens=8, ignore_eos=True
    )[0]
    with ServerThread(Engine(served.model, served.tokenizer), model_name=served.name) as srv:
        r = httpx.post(
            f"{srv.url}/v1/completions",
            json={
                "model": "tiny-hf",
                "prompt": "the lazy",
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text


def test_bad_arguments_are_one_line(run_dir: Path, tmp_path: Path, capsys) -> None:
    assert cli.main(["serve", str(tmp_path / "missing")]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "no such run" in err and "\n" not in err
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        assert cli.main(["serve", str(run_dir), "--port", str(port)]) != 0
        err = capsys.readouterr().err.strip()
        assert f"cannot listen on 127.0.0.1:{port}" in err and "\n" not in err
    finally:
        taken.close()
    assert cli.main(["serve", str(run_dir), "--port", "70000"]) != 0
    assert "--port" in capsys.readouterr().err
