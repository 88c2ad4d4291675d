"""``llmkit info SPEC --parallel …``: the plan of a layout on paper, and its errors."""

from __future__ import annotations

import json

import pytest

from llmkit.cli import main
from tests.conftest import SPECS


def test_info_plans_a_layout_on_h100s(capsys):
    args = ["info", "llama-3.2-1b", "--parallel", "dp=8,tp=2", "--gpus", "H100", "--json"]
    assert main([*args, "--seq-len", "1024", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "parallel plan: dp_shard=8 × tp=2 = 16 GPUs (H100)" in out
    assert "fits H100 (74.5 GiB)" in out
    for dim in ("fsdp", "ddp", "tp", "cp", "pp", "total"):
        assert any(line.split()[:1] == [dim] for line in out.splitlines()), dim
    assert "step time ≥" in out and "tokens/s/GPU" in out
    numbers = json.loads(out[out.rindex("\n{") :])
    plan = numbers["parallel_plan"]
    assert plan["layout"]["world"] == 16 and plan["fits"] is True
    assert plan["comm"]["ddp"] == plan["comm"]["cp"] == plan["comm"]["pp"] == 0
    assert plan["comm"]["tp"] > 0 and plan["comm"]["fsdp"] > 0
    mem = plan["memory"]
    # 1,235,814,400 parameters: tp halves all but the norms, dp_shard = 8 shards the rest
    assert 1_235_814_400 // 16 * 4 <= mem["params"] <= 1_235_814_400 // 16 * 4 + 20_000
    assert mem["optimizer"] == 2 * mem["params"]


def _error(capsys, *args: str) -> str:
    assert main(["info", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert captured.out == ""  # refused before printing anything
    return lines[0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dp=8,xx=2", "'xx=2' is not NAME=N"),
        ("tp=two", "'two' is not an integer"),
        ("tp=0", "degrees are ≥ 1"),
    ],
)
def test_bad_parallel_text_is_one_line(capsys, text, message):
    line = _error(capsys, "llama-3.2-1b", "--parallel", text)
    assert line.startswith("error: --parallel") and message in line


def test_a_layout_that_cannot_split_the_model_is_one_line(capsys):
    line = _error(capsys, str(SPECS / "tiny.toml"), "--parallel", "dp=2,tp=4")
    assert "tp = 4 does not divide n_heads = 6" in line
    line = _error(capsys, "llama-3.2-1b", "--parallel", "pp=4", "--batch-size", "6")
    assert "4 pipeline micro-batches do not divide the batch of 6" in line
    line = _error(capsys, "llama-3.2-1b", "--parallel", "dp=2", "--gpus", "v100")
    assert "unknown GPU 'v100'" in line
    line = _error(capsys, "llama-3.2-1b", "--gpus", "h100")
    assert "give --parallel too" in line


def test_layout_problems_are_warnings(capsys):
    """What the spec cannot train with but the plan can still count: a warning line."""
    args = ["info", "llama-3.2-1b", "--parallel", "pp=4", "--microbatches", "2"]
    assert main([*args, "--batch-size", "8"]) == 0
    captured = capsys.readouterr()
    assert "warning: train.parallel: 1f1b needs microbatches ≥ pp (2 < 4)" in captured.err
    assert "memory per GPU (pipeline rank" in captured.out
