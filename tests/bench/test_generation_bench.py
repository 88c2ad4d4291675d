"""``llmkit bench generate`` and :func:`llmkit.bench.generation.bench_generate`."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from llmkit import cli, hardware
from llmkit.bench import generation
from llmkit.bench.generation import bandwidth_limit, bench_generate
from llmkit.data.tokenizer import train_char
from llmkit.inference.quantize import decode_read_bytes, dynamic_available, quantize_model
from llmkit.model import build_model
from llmkit.runs import TOKENIZER_FILE, save_spec
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with random weights and a character tokenizer."""
    tok = train_char(["the quick brown fox jumps over the lazy dog.\n"])
    path = tmp_path_factory.mktemp("run")
    spec = tiny_spec(vocab_size=tok.vocab_size, position={"name": "rope"}, max_seq_len=64)
    spec["tokenizer"] = {"kind": "char"}
    rs = load_spec_dict(spec)
    torch.manual_seed(0)
    save_spec(rs, path)
    save_weights(build_model(rs), path / WEIGHTS)
    tok.save(path / TOKENIZER_FILE)
    return path


def test_bench_generate_reports_every_figure_and_a_bounded_window_cache():
    spec = tiny_spec(attention={"name": "sliding_window", "window": 4}, max_seq_len=64)
    model = build_model(load_spec_dict(spec))
    short, long = (
        bench_generate(model, batch_sizes=(2,), prompt_len=8, new_tokens=n, repeats=1)[0]
        for n in (4, 40)
    )
    assert long.kv_cache and long.batch_size == 2 and long.new_tokens == 40
    assert long.prefill_tokens_per_s > 0 and long.decode_tokens_per_s > 0 and long.ttft_s > 0
    assert long.peak_memory_bytes > long.weight_bytes > 0
    assert long.kv_cache_bytes == short.kv_cache_bytes > 0  # the window bounds the cache
    dense = build_model(load_spec_dict(tiny_spec(max_seq_len=64)))
    grown = bench_generate(dense, batch_sizes=(2,), prompt_len=8, new_tokens=40, repeats=1)[0]
    assert grown.kv_cache_bytes > long.kv_cache_bytes


def test_cli_bench_generate_json(run_dir, capsys):
    argv = ["bench", "generate", str(run_dir), "--batch-sizes", "1,2", "--prompt-len", "4"]
    assert cli.main([*argv, "--new-tokens", "3", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["batch_size"] for r in out["results"]] == [1, 2]
    assert {"prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s", "peak_memory_bytes"} <= set(
        out["results"][0]
    )
    assert cli.main([*argv, "--new-tokens", "3", "--repeats", "1", "--quantize", "int8"]) == 0
    assert "decode tok/s" in capsys.readouterr().out
    assert cli.main(["bench", "generate", str(run_dir), "--batch-sizes", "x"]) == 2


def test_the_bandwidth_bound_is_bytes_per_step_over_bandwidth():
    assert bandwidth_limit(125_000_000, 20e9) == pytest.approx(160.0)
    with pytest.raises(ValueError):
        bandwidth_limit(0, 20e9)
    model = quantize_model(build_model(load_spec_dict(tiny_spec(max_seq_len=64))), "int8")
    read = decode_read_bytes(model)
    rows = bench_generate(
        model, batch_sizes=(1, 3), prompt_len=4, new_tokens=5, repeats=1, bandwidth=1e9
    )
    for r in rows:
        assert r.read_bytes_per_step == read and r.read_bandwidth == 1e9
        assert r.limit_tokens_per_s == pytest.approx(1e9 / read)
        per_seq = r.decode_tokens_per_s / r.batch_size
        assert r.fraction_of_limit == pytest.approx(per_seq / r.limit_tokens_per_s)


def test_read_bandwidth_is_measured():
    bw = hardware.measure_read_bandwidth(nbytes=8 * 2**20, repeats=2)
    assert 1e8 < bw < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s
    llc = hardware.last_level_cache_bytes()
    assert llc is None or llc > 0


def test_cli_prints_the_bandwidth_limit(run_dir, capsys, monkeypatch):
    monkeypatch.setattr(generation, "measure_read_bandwidth", lambda device: 2e9)
    argv = ["bench", "generate", str(run_dir), "--batch-sizes", "1", "--prompt-len", "4"]
    assert cli.main([*argv, "--new-tokens", "3", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["results"][0]
    read = result["read_bytes_per_step"]
    assert read > 0 and result["read_bandwidth"] == 2e9
    assert result["limit_tokens_per_s"] == pytest.approx(2e9 / read)
    assert cli.main([*argv, "--new-tokens", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "read bandwidth 2.0 GB/s" in out and "of limit" in out
    assert f"limit {2e9 / read:,.1f} tok/s per sequence" in out
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: False)
    assert cli.main([*argv, "--new-tokens", "3", "--repeats", "1", "--quantize", "auto"]) == 0
    backend = "dynamic" if dynamic_available() else "weight_only"
    assert f"int8 ({backend})" in capsys.readouterr().out


def test_the_benchmark_uses_only_public_names_of_other_modules():
    tree = ast.parse(Path(generation.__file__).read_text(encoding="utf-8"))
    imported = [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmkit")
        for alias in node.names
    ]
    assert imported and not [i for i in imported if i[1].startswith("_")]
