"""``llmkit info``: exact numbers, and one column per per-layer kind of the registry."""

from __future__ import annotations

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
