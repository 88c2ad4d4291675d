"""Kinds own their kernel benchmark: the runner finds a kind's adapter through its registry
record, so a plugin's kind with ``bench = ...`` is benchmarked like the built-in ones, and a
kind without one is refused in one line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from llmkit.bench import kernels as bk
from llmkit.cli import main
from llmkit.contracts import NoOptions
from llmkit.hookspecs import hookimpl
from llmkit.registry import get_registry, reset_registry
from tests.helpers import registry_with

WIDTH = 16


class Matmul(nn.Module):
    """x @ W over rows of width 16."""

    Options = NoOptions

    def __init__(self, options: NoOptions) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Twice(Matmul):
    """Two matmuls: twice the work."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.proj(x))


@dataclass(frozen=True, kw_only=True)
class RowsBench(bk.KernelBench):
    """A plugin kind's adapter: components built as ``Component(options)``, called on
    (rows, 16) inputs, forward only."""

    def fields(self, case: bk.Case) -> dict[str, Any]:
        return {"rows": case.size, "width": WIDTH}

    def prepare(self, entry: bk.Entry, case: bk.Case) -> bk.Prepared:
        if case.mode != "fwd":
            raise bk.Unsupported("forward only")
        module = entry.record.load()(entry.record.parse_options(entry.options))
        x = torch.randn(case.size, WIDTH, generator=torch.Generator().manual_seed(case.seed))
        matmuls = 2 if isinstance(module, Twice) else 1

        def step() -> torch.Tensor:
            with torch.no_grad():
                return module(x)

        flops = 2.0 * case.size * WIDTH * WIDTH * matmuls
        return bk.Prepared(step, flops, None, {"rows": case.size, "width": WIDTH})

    def shape_note(self, records: list[dict[str, Any]]) -> str:
        return f", width {WIDTH}"


ROWS_BENCH = RowsBench(
    baseline="matmul",
    columns=(bk.Column("rows", "rows", "rows"),),
    sizes={"cpu": (8, 32)},
    quick_sizes=(8,),
    work="2·rows·16² per matmul",
)


class MixerPlugin:
    """Declares the kind ``mixer`` with this module's adapter, and two components."""

    def __init__(self, bench: str | None) -> None:
        self.bench = bench

    @hookimpl
    def register_kinds(self, register):
        register("mixer", "Row mixers (a kind only these tests know)", bench=self.bench)

    @hookimpl
    def register_components(self, register):
        register("mixer", "matmul", Matmul)
        register("mixer", "twice", Twice)


def _registry(bench: str | None = f"{__name__}:ROWS_BENCH") -> Any:
    reg = registry_with(MixerPlugin(bench))
    assert not reg.failures(), reg.failures()
    return reg


@pytest.fixture
def mixer_registry():
    """The process registry with the mixer kind, restored afterwards."""
    reg = _registry()
    reset_registry(reg)
    yield reg
    reset_registry()


def test_builtin_kinds_name_their_adapters():
    reg = get_registry()
    assert bk.benchmarkable_kinds() == ["attention", "ffn", "norm"]
    assert reg.kinds["attention"].load_bench() is bk.ATTENTION_ADAPTER
    assert reg.kinds["ffn"].load_bench() is bk.FFN_ADAPTER
    assert reg.kinds["norm"].load_bench() is bk.NORM_ADAPTER
    assert [bk.adapter_for(k).baseline for k in ("attention", "ffn", "norm")] == [
        "sdpa",
        "swiglu",
        "rmsnorm",
    ]


def test_a_plugin_kind_with_an_adapter_is_benchmarked():
    reg = _registry()
    assert bk.benchmarkable_kinds(reg) == ["attention", "ffn", "norm", "mixer"]
    entries = bk.entries("mixer", registry=reg)
    records = bk.bench_kernels(
        "mixer", entries, sizes=(8, 32), warmup=0, repeats=1, min_repeat_s=0.0, registry=reg
    )
    assert len(records) == 2 * 2 * 2  # components × sizes × modes
    by = {(r["component"], r["mode"], r["rows"]): r for r in records}
    for rows in (8, 32):
        for name, matmuls in (("matmul", 1), ("twice", 2)):
            r = by[(name, "fwd", rows)]
            assert r["status"] == "ok", r["reason"]
            assert r["kind"] == "mixer" and r["width"] == WIDTH and r["provider"] == "fake-0"
            assert r["flops"] == 2 * rows * WIDTH * WIDTH * matmuls and r["tflops"] > 0
            assert r["peak_memory_bytes"] > 0
            skipped = by[(name, "fwd+bwd", rows)]
            assert skipped["status"] == "skipped" and skipped["reason"] == "forward only"


def test_the_command_benchmarks_a_plugin_kind(mixer_registry, capsys, tmp_path):
    argv = ["bench", "kernels", "--kind", "mixer", "--quick", "--modes", "fwd"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mixer kernels on" in out and ", width 16)" in out
    assert "rows" in out and "speed vs matmul" in out and "twice" in out
    data = json.loads((tmp_path / "kernels-mixer-cpu.json").read_text())
    assert data["meta"]["flops"] == "2·rows·16² per matmul" and data["meta"]["bytes"] is None
    assert {r["rows"] for r in data["records"]} == {8}  # the adapter's quick sizes
    twice = next(r for r in data["records"] if r["component"] == "twice")
    assert twice["baseline"] == "matmul" and twice["speedup"] > 0
    assert (tmp_path / "kernels-mixer-cpu.png").exists()
    pivot = bk.pivot_markdown(data["records"], "matmul")
    assert pivot.startswith("| mode | rows | matmul TFLOP/s | twice TFLOP/s | twice / matmul |")


def test_a_kind_without_an_adapter_is_refused_in_one_line(capsys, tmp_path):
    with pytest.raises(bk.NotBenchmarkable) as info:
        bk.bench_kernels("position", bk.entries("position"))
    message = str(info.value)
    assert "'position' has no kernel benchmark" in message and "\n" not in message
    assert message.endswith("benchmarkable kinds: attention, ffn, norm")
    assert isinstance(info.value, ValueError)  # as the unknown-kind error always was
    reg = _registry(bench=None)  # a plugin kind that declares no adapter
    with pytest.raises(bk.NotBenchmarkable, match="'mixer' has no kernel benchmark"):
        bk.adapter_for("mixer", reg)
    with pytest.raises(bk.NotBenchmarkable, match="did you mean 'mixer'"):
        bk.adapter_for("mixr", reg)
    assert main(["bench", "kernels", "--kind", "position", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --kind: kind 'position' has no kernel benchmark")
    assert err.strip().count("\n") == 0 and "attention, ffn, norm" in err


def test_a_broken_adapter_is_named():
    reg = _registry(bench=f"{__name__}:NO_SUCH_ADAPTER")
    with pytest.raises(bk.NotBenchmarkable, match=r"NO_SUCH_ADAPTER.*failed to load"):
        bk.adapter_for("mixer", reg)
    reg = _registry(bench=f"{__name__}:WIDTH")
    with pytest.raises(
        bk.NotBenchmarkable, match=r"is not a llmkit\.bench\.kernels\.KernelBench \(got int\)"
    ):
        bk.adapter_for("mixer", reg)
