"""``llmkit info``: exact numbers, and one column per per-layer kind of the registry."""

from __future__ import annotations

import json
from types import SimpleNamespace

from llmkit.cli import main
from llmkit.cli.info import layer_table
from llmkit.registry import get_registry
from llmkit.spec.resolved import LayerPlan
from tests.conftest import SPECS


def test_info_reports_gpt2_small_exactly(capsys):
    assert main(["info", str(SPECS / "gpt2-small.toml"), "--json"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out
    for text in ("FLOPs/token", "KV cache", "training step memory", "layer"):
        assert text in out
    assert "optimizer: adamw" in out and "schedule: " in out


def test_info_shows_every_layer_component(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: no cell folds
    assert main(["info", str(SPECS / "local-global.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.count("sliding_window(window=128)") == 3
    assert out.count("mlp(activation=relu2)") == 2
    header = next(line for line in out.splitlines() if line.startswith("layers")).split()
    per_layer = [k.slot for k in get_registry().kinds.values() if k.per_layer]
    assert header[1:5] == ["attention", "ffn", "norm", "position"]
    assert set(header[1:]) <= set(per_layer)


def _res(name: str, **options):
    dump = {k: v for k, v in options.items() if v is not None}
    return SimpleNamespace(name=name, options=SimpleNamespace(model_dump=lambda **_: dump))


def test_layer_table_takes_any_slot_and_merges_identical_layers():
    """A per-layer kind a plugin declares is a column like any other; a slot no layer fills
    adds no column."""
    plans = [
        LayerPlan(ffn=_res("mlp"), gate=_res("soft", k=2)),
        LayerPlan(ffn=_res("mlp"), gate=_res("soft", k=2)),
        LayerPlan(ffn=_res("moe")),
    ]
    columns, rows = layer_table(SimpleNamespace(layers=plans), ["ffn", "gate", "unused"])
    assert columns == ["ffn", "gate"]
    assert rows == [("0-1", "mlp", "soft(k=2)"), ("2", "moe", "-")]


def _memory_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("training step memory"))


def test_info_names_the_batch_and_context_of_its_memory_estimate(capsys):
    """A preset's full context (131,072 tokens for llama-3.2-1b) would estimate terabytes:
    the default context is capped at 2048, and the line says so."""
    assert main(["info", "llama-3.2-1b", "--json"]) == 0
    out = capsys.readouterr().out
    line = _memory_line(out)
    assert line.startswith(
        "training step memory @ batch 8 × context 2,048 (context: max_seq_len 131,072 "
        "capped at 2,048; choose with --batch-size, --seq-len): "
    )
    assert "TiB" not in line
    assert "FLOPs/token @ T=2048:" in out
    numbers = json.loads(out[out.rindex("\n{") :])
    assert (numbers["batch_size"], numbers["seq_len"]) == (8, 2048)

    assert main(["info", "llama-3.2-1b", "--batch-size", "2", "--seq-len", "131072"]) == 0
    line = _memory_line(capsys.readouterr().out)
    assert "@ batch 2 × context 131,072 (context: --seq-len;" in line


def test_info_takes_the_spec_block_size_as_its_context(capsys):
    spec = str(SPECS / "gpt2-small.toml")
    assert main(["info", spec, "--set", "data.block_size=256"]) == 0
    assert "@ batch 8 × context 256 (context: data.block_size;" in _memory_line(
        capsys.readouterr().out
    )
    assert main(["info", spec]) == 0  # max_seq_len 1024: no cap
    assert "@ batch 8 × context 1,024 (context: max_seq_len;" in _memory_line(
        capsys.readouterr().out
    )
