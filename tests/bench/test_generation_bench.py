"""``llmkit bench generate`` and :func:`llmkit.bench.generation.bench_generate`."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from llmkit import cli
from llmkit.bench import generation
from llmkit.bench.generation import bench_generate
from llmkit.data.tokenizer import train_char
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


def test_the_benchmark_uses_only_public_names_of_other_modules():
    tree = ast.parse(Path(generation.__file__).read_text(encoding="utf-8"))
    imported = [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmkit")
        for alias in node.names
    ]
    assert imported and not [i for i in imported if i[1].startswith("_")]
