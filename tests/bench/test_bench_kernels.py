"""Kernel benchmarks (llmkit.bench.kernels, `llmkit bench kernels`, benchmarks/scripts/gpu_check.py)
on tiny CPU shapes: records, FLOP formulas, the memory measure, JSON/PNG/table output, the
command line's errors, and the GPU check's CPU dry run."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from rich.console import Console
from torch import Tensor

from llmkit import hardware
from llmkit.bench import kernels as bk
from llmkit.cli import main
from llmkit.components.attention.sdpa import SDPAttention
from llmkit.contracts import AttentionKernel, BuildContext, ComponentOptions, NoOptions
from llmkit.registry import Component, get_registry
from tests.conftest import ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_thread")


def _entry(name: str, **options) -> bk.Entry:
    return bk.Entry(name, get_registry().get("attention", name), options)


def _tiny_attention(entries, **kw):
    args = dict(device="cpu", sizes=(32,), head_dims=(16,), batch=1, heads=2, warmup=0)
    args.update(repeats=1, min_repeat_s=0.0)
    args.update(kw)
    return bk.bench_kernels("attention", entries, **args)


# -- FLOP counts ------------------------------------------------------------------------------


def test_attention_flop_formulas():
    n, d = 1024, 64
    assert bk.attention_flops(1, 1, n, d, causal=False) == 4 * n * n * d
    assert bk.attention_flops(2, 3, n, d) == 4 * 2 * 3 * n * n * d / 2  # causal: half
    assert bk.attention_flops(1, 1, n, d, mode="fwd+bwd") == 3.5 * 4 * n * n * d / 2
    # a window: N·W − W²/2 pairs; a window as long as the sequence is plain causal
    assert bk.attention_flops(1, 1, n, d, window=256) == 4 * d * (n * 256 - 256**2 / 2)
    assert bk.attention_flops(1, 1, n, d, window=n) == bk.attention_flops(1, 1, n, d)
    assert bk.attention_flops(1, 1, n, d, window=4 * n) == bk.attention_flops(1, 1, n, d)
    assert bk.norm_bytes(10, 8, 4, "fwd") == 2 * 10 * 8 * 4
    assert bk.norm_bytes(10, 8, 4, "fwd+bwd") == 5 * 10 * 8 * 4
    with pytest.raises(ValueError, match="mode"):
        bk.attention_flops(1, 1, n, d, mode="bwd")


def test_ffn_flops_count_the_matmuls():
    """SwiGLU: three d×h projections, 2 FLOPs per weight per token; backward twice that."""
    entry = bk.Entry("swiglu", get_registry().get("ffn", "swiglu"))
    ctx = BuildContext(d_model=32, n_heads=1, n_kv_heads=1, head_dim=32, max_seq_len=16,
                          n_layers=1)  # fmt: skip
    h = bk.build(entry, ctx, "cpu", torch.float32).gate_proj.out_features
    fwd = bk.prepare_tokens(entry, tokens=16, d_model=32, mode="fwd")
    assert fwd.flops == 2 * 16 * 3 * 32 * h
    both = bk.prepare_tokens(entry, tokens=16, d_model=32, mode="fwd+bwd")
    assert both.flops == 3 * fwd.flops


# -- records ----------------------------------------------------------------------------------


def test_attention_records_have_every_field():
    entries = [_entry("sdpa"), _entry("dense"), _entry("sliding_window", window=8)]
    records = bk.add_ratios(_tiny_attention(entries, sizes=(32, 64)), "sdpa")
    assert len(records) == 3 * 2 * 2  # entries × sizes × modes
    for r in records:
        assert r["status"] == "ok", r["reason"]
        for key in ("component", "provider", "mode", "device", "dtype", "batch", "heads"):
            assert r[key] is not None
        assert r["device"] == "cpu" and r["dtype"] == "float32" and r["head_dim"] == 16
        assert r["median_s"] > 0 and r["min_s"] <= r["median_s"] and r["repeats"] == 1
        assert r["tflops"] == pytest.approx(r["flops"] / r["median_s"] / 1e12)
        assert r["peak_memory_bytes"] > 0 and "profiler" in r["memory_method"]
        window = 8 if r["component"] == "sliding_window" else None
        assert r["window"] == window
        want = bk.attention_flops(1, 2, r["seq_len"], 16, window=window, mode=r["mode"])
        assert r["flops"] == want
        if r["component"] == "sdpa":
            assert r["speedup"] == 1.0 and r["memory_ratio"] == 1.0
        else:
            assert r["speedup"] > 0 and r["baseline"] == "sdpa"
        # one repeat: no spread, so nothing to judge noise by
        assert r["times_s"] == [r["median_s"]] == [r["max_s"]]
        assert r["spread"] is None and r["within_noise"] is None


def test_records_carry_the_spread_of_their_repeats():
    records = bk.add_ratios(_tiny_attention([_entry("sdpa"), _entry("dense")], repeats=3), "sdpa")
    for r in records:
        assert len(r["times_s"]) == r["repeats"] == 3
        assert r["min_s"] == min(r["times_s"]) <= r["median_s"] <= max(r["times_s"]) == r["max_s"]
        assert r["spread"] == pytest.approx((r["max_s"] - r["min_s"]) / r["median_s"])
        if r["component"] == "sdpa":  # the baseline against itself
            assert r["within_noise"] is None
        else:
            assert isinstance(r["within_noise"], bool)


def _timed(component: str, times_ms: list[float], **case) -> dict:
    """A record as bench_kernels makes one, with the given repeat times (ms)."""
    times = [t / 1e3 for t in times_ms]
    rec = {"kind": "ffn", "device": "cpu", "dtype": "float32", "mode": "fwd", "tokens": 64}
    rec.update(component=component, status="ok", reason=None, tflops=1.0, peak_memory_bytes=1)
    rec.update(bk.summarize(times), repeats=len(times), number=1, d_model=32, **case)
    return rec


def test_a_speed_ratio_inside_the_noise_is_marked():
    """Same code, noisy repeats: 2.6× by the medians, yet the ranges overlap; a real 2×
    with tight repeats is not marked; a single repeat cannot tell."""
    records = [
        _timed("swiglu", [0.26, 0.25, 0.09]),
        _timed("swiglu_triton", [0.10, 0.09, 0.11]),
        _timed("swiglu", [0.200, 0.202, 0.201], tokens=256),
        _timed("fast", [0.100, 0.101, 0.099], tokens=256),
        _timed("swiglu", [0.2], tokens=1024),
        _timed("fast", [0.1], tokens=1024),
    ]
    base, triton, _, real, _, one = bk.add_ratios(records, "swiglu")
    assert triton["speedup"] == pytest.approx(2.5) and triton["within_noise"] is True
    assert real["speedup"] == pytest.approx(2.0, rel=0.02) and real["within_noise"] is False
    assert one["speedup"] == pytest.approx(2.0) and one["within_noise"] is None
    assert base["within_noise"] is None  # the baseline against itself
    assert base["spread"] == pytest.approx((0.26 - 0.09) / 0.25)
    headers, rows, notes = bk.table_rows(records, "swiglu")
    assert headers[headers.index("median") + 1] == "spread"
    speed = {(row[0], row[2]): row[headers.index("speed vs swiglu")] for row in rows}
    assert speed[("swiglu_triton", "64")] == "2.50× (noise)"
    assert speed[("fast", "256")] == "2.01×" and speed[("fast", "1024")] == "2.00×"
    assert speed[("swiglu", "64")] == "1.00×"
    assert notes == [bk.NOISE_NOTE]
    spread = {(row[0], row[2]): row[headers.index("spread")] for row in rows}
    assert spread[("swiglu", "64")] == "68%" and spread[("fast", "1024")] == "-"
    assert "2.50× (noise)" in bk.pivot_markdown(records, "swiglu")
    assert bk.markdown_table(records, "swiglu").rstrip().endswith(bk.NOISE_NOTE)


def test_an_entrys_context_is_entered_once_around_the_calls():
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    entered = []

    @contextlib.contextmanager
    def flash_only():
        entered.append(1)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            yield

    entry = bk.Entry("sdpa-flash", get_registry().get("attention", "sdpa"), context=flash_only)
    records = _tiny_attention([entry], repeats=3)
    assert [r["status"] for r in records] == ["ok", "ok"] and len(entered) == 2


def test_cpu_peak_memory_counts_what_torch_allocates():
    """Dense attention materializes the (B, H, N, N) fp32 scores; SDPA's CPU flash kernel
    does not. The profiler-based measure sees exactly that."""
    records = _tiny_attention([_entry("dense"), _entry("sdpa")], sizes=(256,), modes=("fwd",))
    by = {r["component"]: r["peak_memory_bytes"] for r in records}
    scores = 1 * 2 * 256 * 256 * 4
    assert by["dense"] >= scores
    assert by["sdpa"] < scores / 2
    # steady: the same call measures the same
    step = bk.prepare_attention(
        _entry("dense"), batch=1, heads=2, seq_len=256, head_dim=16, mode="fwd"
    ).step
    assert bk.cpu_peak_allocated(step) == bk.cpu_peak_allocated(step) == by["dense"]


class _Refuses(AttentionKernel):
    Options = NoOptions

    def forward(self, q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:
        raise NotImplementedError("head dim 16 is not supported")


class _NeedsSizeOptions(ComponentOptions):
    size: int


class _NeedsSize(SDPAttention):
    Options = _NeedsSizeOptions


class _Broken(AttentionKernel):
    Options = NoOptions

    def forward(self, q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:
        raise RuntimeError("boom")


def test_components_that_cannot_run_a_case_are_skipped_with_a_reason():
    fakes = [
        Component("attention", "refuses", _Refuses),
        Component("attention", "needs_size", _NeedsSize),
        Component("attention", "gpu_only", SDPAttention, capabilities={"requires": ["cuda"]}),
        Component("attention", "broken", _Broken),
    ]
    entries = [_entry("sliding_window"), _entry("sdpa")]
    entries += [bk.Entry(f.name, f) for f in fakes]
    records = _tiny_attention(entries, causal=False, modes=("fwd",))
    by = {r["component"]: r for r in records}
    assert by["sdpa"]["status"] == "ok"
    assert by["sliding_window"]["status"] == "skipped"
    assert "causal" in by["sliding_window"]["reason"]
    assert by["refuses"]["status"] == "skipped"
    assert "head dim 16 is not supported" in by["refuses"]["reason"]
    assert by["needs_size"]["status"] == "skipped" and "validate" in by["needs_size"]["reason"]
    assert by["gpu_only"]["status"] == "skipped" and "cuda" in by["gpu_only"]["reason"]
    assert by["broken"]["status"] == "error" and "boom" in by["broken"]["reason"]
    _, rows, notes = bk.table_rows(records, "sdpa")
    assert len(rows) == 1 and len(notes) == 5


def test_ffn_and_norm_records():
    reg = get_registry()
    for kind, metric in (("ffn", "tflops"), ("norm", "gbps")):
        entries = [bk.Entry(r.name, r) for r in reg.list(kind)]
        records = bk.bench_kernels(
            kind, entries, device="cpu", sizes=(16,), d_model=32, warmup=0, repeats=1,
            min_repeat_s=0.0,
        )  # fmt: skip
        assert {r["component"] for r in records} == {r.name for r in reg.list(kind)}
        for r in records:
            assert r["status"] == "ok", (r["component"], r["reason"])
            assert r[metric] > 0 and r["tokens"] == 16 and r["d_model"] == 32
            assert r["peak_memory_bytes"] > 0
    x = bk.prepare_tokens(bk.Entry("rmsnorm", reg.get("norm", "rmsnorm")), tokens=16,
                          d_model=32, mode="fwd")  # fmt: skip
    assert x.bytes_moved == 2 * 16 * 32 * 4 and x.flops is None


def test_a_plugins_components_join_the_benchmarks(monkeypatch):
    """Every registered component is benchmarked, a plugin's too (llmkit-extras)."""
    from llmkit.registry import reset_registry

    monkeypatch.setenv("LLMKIT_PLUGINS", "extras")
    reset_registry()
    try:
        reg = get_registry()
        if "extras" not in reg.plugins:
            pytest.skip("llmkit-extras is not installed")
        for kind, name in (("norm", "dyt"), ("norm", "scalenorm")):
            found = [e for e in bk.entries(kind) if e.label == name]
            assert found, f"{kind} {name} not among {[e.label for e in bk.entries(kind)]}"
            args = {"sizes": (16,), "modes": ("fwd+bwd",), "warmup": 0, "repeats": 1}
            if kind == "attention":
                records = _tiny_attention(found, **args)
            else:
                records = bk.bench_kernels(kind, found, d_model=32, min_repeat_s=0.0, **args)
            assert records[0]["status"] == "ok", records[0]["reason"]
    finally:
        reset_registry()


# -- output -----------------------------------------------------------------------------------


def test_json_png_and_tables(tmp_path):
    entries = [_entry("sdpa"), _entry("dense")]
    records = bk.add_ratios(_tiny_attention(entries, sizes=(32, 64)), "sdpa")
    meta = bk.meta("attention", "cpu", torch.float32, baseline="sdpa")
    path = bk.write_json(records, tmp_path / "a" / "r.json", meta)
    data = json.loads(path.read_text())
    assert data["meta"]["flops"] == bk.ATTENTION_FLOPS and data["meta"]["torch"]
    assert data["meta"]["cpu_flags"] == hardware.cpu_flags()
    assert len(data["records"]) == len(records)
    png = bk.plot(records, tmp_path / "r.png")
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    con = Console(record=True, width=200)
    con.print(bk.rich_table(records, "sdpa"))
    text = con.export_text()
    assert "speed vs sdpa" in text and "dense" in text and "GFLOP/s" in text
    md = bk.markdown_table(records, "sdpa")
    assert md.count("\n") == 2 + len(records)
    pivot = bk.pivot_markdown(records, "sdpa")
    assert "dense / sdpa" in pivot and pivot.count("\n") == 2 + 4  # 2 sizes × 2 modes


# -- the command line -------------------------------------------------------------------------


def run(capsys, *argv):
    code = main(["bench", "kernels", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kind", "position"], "--kind"),
        (["--seq-lens", "64,abc"], "--seq-lens"),
        (["--seq-lens", "0"], "--seq-lens"),
        (["--head-dims", "x"], "--head-dims"),
        (["--components", "sdpaa"], "did you mean 'sdpa'"),
        (["--dtype", "int8"], "--dtype"),
        (["--dtype", "float16"], "CUDA"),
        (["--device", "tpu"], "--device"),
        (["--modes", "bwd"], "--modes"),
        (["--option", "window=3"], "NAME.KEY=VALUE"),
        (["--option", "nope.window=3"], "nope"),
        (["--repeats", "0"], "--repeats"),
        (
            ["--components", "sliding_window", "--option", "sliding_window.window=0"],
            "--option sliding_window: window: Input should be greater than or equal to 1",
        ),
        (["--option", "sdpa.windw=4"], "--option sdpa: windw: Extra inputs are not permitted"),
        (["--option", "sdpa.dropout=abc"], "--option sdpa: dropout:"),
        (["--baseline", "nope"], "--baseline 'nope' is not among the benchmarked"),
    ],
)
def test_cli_bad_input_is_a_one_line_error(capsys, tmp_path, argv, message):
    code, _, err = run(capsys, "--quick", "--out", str(tmp_path), *argv)
    assert code == 2
    assert err.startswith("error:") and err.strip().count("\n") == 0 and message in err
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cli_cuda_without_a_gpu(capsys):
    code, _, err = run(capsys, "--device", "cuda")
    assert code == 2 and "no CUDA GPU" in err and err.strip().count("\n") == 0


def test_cli_quick_prints_the_table_and_writes_json_and_png(capsys, tmp_path):
    code, out, _ = run(
        capsys, "--quick", "--out", str(tmp_path), "--option", "sliding_window.window=32"
    )
    assert code == 0
    names = get_registry().names("attention")
    for name in names:
        assert name in out
    assert "speed vs sdpa" in out and "1 thread," in out
    data = json.loads((tmp_path / "kernels-attention-cpu.json").read_text())
    assert {r["component"] for r in data["records"]} == set(names)
    assert data["meta"]["quick"] is True
    windows = {r["window"] for r in data["records"] if r["component"] == "sliding_window"}
    assert windows == {32}
    assert (tmp_path / "kernels-attention-cpu.png").read_bytes()[:8] == PNG_MAGIC
    assert torch.get_num_threads() == 1  # the fixture's setting, restored by the command


def test_cli_quick_norm(capsys, tmp_path):
    code, out, _ = run(
        capsys, "--quick", "--kind", "norm", "--modes", "fwd", "--out", str(tmp_path)
    )
    assert code == 0 and "GB/s" in out and "speed vs rmsnorm" in out
    assert (tmp_path / "kernels-norm-cpu.json").exists()


# -- the GPU check's dry run ------------------------------------------------------------------


def test_gpu_check_dry_run(tmp_path, capsys):
    from benchmarks.scripts import gpu_check

    code = gpu_check.main(["--dry-run", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    md = (tmp_path / "gpu_check.md").read_text()
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    registered = [
        c for c in gpu_check.CHECKS if c.split(".")[1] in get_registry().names(c.split(".")[0])
    ]
    assert code == (0 if len(registered) == len(gpu_check.CHECKS) else 1), out
    assert data["checks"] and all(c["ok"] for c in data["checks"]), md
    assert {c["component"] for c in data["checks"]} == {c.split(".")[1] for c in registered}
    assert "sdpa-flash" in md and "## Attention speed" in md
    names = {r["component"] for r in data["benchmarks"]["attention"]}
    assert "sdpa-flash" in names
    assert all(r["status"] == "ok" for r in data["benchmarks"]["attention"])
    assert (tmp_path / "gpu_check_attention.png").exists()


def test_gpu_check_reports_missing_components(tmp_path, capsys):
    from benchmarks.scripts import gpu_check

    argv = ["--dry-run", "--skip-bench", "--out", str(tmp_path), "--components"]
    code = gpu_check.main([*argv, "attention.nope,norm.rmsnorm"])
    assert code == 1
    md = (tmp_path / "gpu_check.md").read_text()
    assert "attention.nope" in md and "rmsnorm" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_gpu_check_without_cuda_fails_clearly(tmp_path):
    """The shell wrapper, as it would be run: no GPU → exit 2 with a one-line reason."""
    script = ROOT / "benchmarks" / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = {**os.environ, "PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    if not os.path.exists(env["PYTHON"]):
        env["PYTHON"] = "python3"
    proc = subprocess.run(
        ["bash", str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "error: gpu_check needs a CUDA GPU" in proc.stderr
