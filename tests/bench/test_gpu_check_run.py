"""The prepared GPU run (benchmarks/scripts/gpu_run.py, gpu_train_compare.py, nanogpt_data.py)
on the CPU: stage budgets and the deadline, pytest counts, the 8-file limit, summaries
rewritten as the run goes, parsing of nanoGPT's log lines and llmkit's metrics.jsonl, the
end-to-end plan under a budget, and (one slower test) the real training commands at a tiny
shape."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks import reference_gpt
from benchmarks.scripts import gpu_run, nanogpt_data
from benchmarks.scripts import gpu_train_compare as e2e
from tests.conftest import ROOT

# -- budgets ----------------------------------------------------------------------------------


def test_a_stage_ends_at_the_sum_of_the_budgets_so_far_never_past_the_deadline():
    stages = gpu_run.DEFAULT_STAGES
    b = {"kernel_tests": 10.0, "gpu_tests": 20.0, "tune": 5.0, "tables": 30.0, "e2e": 40.0}
    ends = [gpu_run.stage_end(s, stages, b, 100.0, 1000.0) for s in stages]
    assert ends == [110.0, 130.0, 160.0, 200.0]  # time left unused rolls to the next stage
    assert gpu_run.stage_end("e2e", stages, b, 100.0, 150.0) == 150.0
    only = ("tables", "e2e")
    assert gpu_run.stage_end("e2e", only, b, 0.0, 1000.0) == 70.0
    # the tune stage, when asked for, runs before the tables and takes its budget
    assert gpu_run.stage_end("tables", gpu_run.STAGES, b, 0.0, 1000.0) == 65.0
    default = sum(gpu_run.BUDGETS[s] for s in gpu_run.DEFAULT_STAGES)
    assert default <= gpu_run.DEADLINE_S <= 8 * 60


def test_budgets_parse_and_refuse_unknown_stages():
    got = gpu_run.parse_budgets(["e2e=200,tables=100", "kernel_tests=5"])
    assert got["e2e"] == 200 and got["tables"] == 100 and got["kernel_tests"] == 5
    assert got["gpu_tests"] == gpu_run.BUDGETS["gpu_tests"]
    with pytest.raises(SystemExit, match="STAGE=SECONDS"):
        gpu_run.parse_budgets(["nope=3"])


def test_at_most_eight_files_come_back():
    assert len(gpu_run.OUT_FILES) <= gpu_run.MAX_OUT_FILES == 8
    assert all(set(n) <= set("abcdefghijklmnopqrstuvwxyz0123456789._-") for n in gpu_run.OUT_FILES)


# -- pytest output ----------------------------------------------------------------------------


def test_pytest_counts_from_the_summary_line():
    text = "..F.s\nFAILED tests/x.py::t - boom\n"
    text += "= 1 failed, 3 passed, 1 skipped, 2 warnings in 4.2s ="
    counts, how = gpu_run.pytest_counts(text)
    assert how == "summary"
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (3, 1, 1)
    counts, _ = gpu_run.pytest_counts("2 passed, 1 error in 0.5s")
    assert counts["errors"] == 1 and counts["passed"] == 2
    counts, how = gpu_run.pytest_counts("tests/kernels/a.py::t\n\n236 tests collected in 9.1s")
    assert how == "summary" and counts["collected"] == 236


def test_pytest_counts_of_a_run_cut_short_come_from_its_progress():
    text = (
        "tests/kernels/test_a.py ..F.s                     [ 10%]\n"
        "tests/kernels/test_b.py ..xE\n"  # killed mid-file
        "....sss..                                          [ 40%]\n"  # xdist: no file names
    )
    counts, how = gpu_run.pytest_counts(text)
    assert how == "progress"
    assert counts["passed"] == 3 + 2 + 6 and counts["failed"] == 1 and counts["errors"] == 1
    assert counts["skipped"] == 1 + 3 and counts["xfailed"] == 1
    assert gpu_run.pytest_counts("Killed")[1] == "none"


def test_junit_counts_and_notes(tmp_path: Path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="3" tests="10">'
        "</testsuite></testsuites>"
    )
    assert gpu_run.junit_counts(xml) == {"passed": 4, "failed": 2, "errors": 1, "skipped": 3,
                                         "xfailed": 0, "xpassed": 0}  # fmt: skip
    assert gpu_run.junit_counts(tmp_path / "none.xml") is None
    failed, skipped = gpu_run.pytest_notes(
        "FAILED tests/a.py::t - x\nERROR tests/b.py::u\nSKIPPED [2] tests/c.py:3: no GPU\n"
    )
    assert failed == ["FAILED tests/a.py::t - x", "ERROR tests/b.py::u"]
    assert skipped == ["SKIPPED [2] tests/c.py:3: no GPU"]


# -- log parsing ------------------------------------------------------------------------------

NANOGPT_LOG = """tokens per iteration will be: 12,288
found vocab_size = 65 (inside data/shakespeare_char/meta.pkl)
step 0: train loss 4.2874, val loss 4.2823
iter 0: loss 4.2654, time 31234.12ms, mfu -100.00%
iter 1: loss 3.9012, time 24.50ms, mfu -100.00%
iter 5: loss 3.1000, time 23.10ms, mfu 104.51%
iter 6: loss nan, time 23.30ms, mfu 104.20%
"""


def test_nanogpt_and_reference_lines_parse():
    got = e2e.parse_iter_lines(NANOGPT_LOG)
    assert [g[0] for g in got] == [0, 1, 5, 6]
    assert got[0][2] == pytest.approx(31234.12) and got[0][3] == -100.0
    assert got[2][1:] == (3.1, 23.10, 104.51)
    assert np.isnan(got[3][1])
    ref = e2e.parse_iter_lines("iter 3: loss 2.5000, time 12.25ms\n{json}")
    assert ref == [(3, 2.5, 12.25, None)]


def test_metrics_jsonl_parses_training_records_only(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": i, "loss": 4.0 - i / 10, "tokens_per_s": 1000.0 * i, "mfu": 0.01 * i}
             for i in range(1, 4)]  # fmt: skip
    lines.append({"step": 3, "val_loss": 3.5})  # an evaluation record
    path.write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 4, "tok')  # cut
    got = e2e.parse_metrics(path, tokens_per_step=100)
    assert [g[0] for g in got] == [0, 1, 2]
    assert got[1][2] == pytest.approx(100 / 2000 * 1e3)  # ms from tokens/s
    assert got[2][3] == pytest.approx(0.03)
    assert e2e.parse_metrics(tmp_path / "missing.jsonl", 100) == []


def test_measure_takes_the_median_after_the_warmup_and_one_mfu_formula():
    res = e2e.Result("k", "nanogpt", "nanoGPT", "eager", 12)
    samples = [(i, 3.0, 1000.0 if i < 3 else 20.0 + i % 2, 50.0) for i in range(10)]
    shape = e2e.GPT2_SMALL
    fpt = shape.flops_per_token()
    e2e.measure(res, samples, 12 * 1024, fpt, warmup=3, own_mfu_scale=0.01)
    assert res.timed == 7 and res.iters == 10 and res.ms_per_iter == 21.0
    assert res.tokens_per_s == pytest.approx(12 * 1024 / 0.021)
    assert res.mfu == pytest.approx(fpt * res.tokens_per_s / e2e.PEAK_FLOPS)
    assert res.own_mfu == pytest.approx(0.5)
    few = e2e.Result("k", "llmkit", "x", "eager", 12)
    e2e.measure(few, samples[:5], 12 * 1024, fpt, warmup=3)
    assert few.ms_per_iter is None and few.timed == 2


def test_the_mfu_formula_is_nanogpts():
    """6·N + 12·L·H·Q·T with N every parameter but the position embedding, as nanoGPT's
    get_num_params() counts them (its GPT has the same parameters as reference_gpt's)."""
    shape = e2e.Shape(2, 2, 64, 32)
    recipe = reference_gpt.Recipe(n_layer=2, n_head=2, n_embd=64, block_size=32)
    model = reference_gpt.GPT(recipe, e2e.VOCAB)
    assert shape.flops_per_token() == model.flops_per_token(32, recipe)
    # GPT-2 small, char vocabulary: about 85.0 M parameters, 623 MFLOP per token
    assert e2e.GPT2_SMALL.flops_per_token() == pytest.approx(623.2e6, rel=1e-3)


# -- the end-to-end plan ----------------------------------------------------------------------


def test_plans_put_batch_12_eager_then_compiled_first():
    keys = [p.key for p in e2e.plans((12, 32), nanogpt=True)]
    assert keys[:8] == [
        "llmkit-flash:eager:b12", "nanogpt:eager:b12", "reference:eager:b12",
        "llmkit-sdpa:eager:b12", "llmkit-flash:compiled:b12", "nanogpt:compiled:b12",
        "reference:compiled:b12", "llmkit-sdpa:compiled:b12",
    ]  # fmt: skip
    assert len(keys) == 16 and len(set(keys)) == 16
    assert all("nanogpt" not in k for k in (p.key for p in e2e.plans((12,), nanogpt=False)))
    assert all(not p.compiled for p in e2e.plans((12,), compiled=False))


def _setup(tmp_path: Path, corpus: Path) -> e2e.Setup:
    cache = tmp_path / "cache"
    (cache / "tokens").mkdir(parents=True)
    (cache / "tokens" / "train-x.bin").write_bytes(b"")
    return e2e.Setup(python=sys.executable, corpus=str(corpus), cache=cache, scratch=tmp_path,
                     device="cpu", shape=e2e.DRY_SHAPE, steps=20, warmup=2)  # fmt: skip


def test_run_all_fits_runs_into_the_budget_and_reports_each(tmp_path: Path, monkeypatch):
    """A compiled run that does not fit the time left is not started, a later eager one
    that fits is; a run cut at its timeout keeps the iterations it logged; every result is
    handed on as it lands."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50)
    s = _setup(tmp_path, corpus)
    clock = [0.0]
    monkeypatch.setattr(e2e.time, "monotonic", lambda: clock[0])
    calls = []

    def runner(cmd, cwd, env, timeout, log, title):
        calls.append((title, timeout))
        clock[0] += {"reference:eager:b4": 30.0}.get(title, 10.0)
        if title.startswith("llmkit"):
            run_dir = Path(cmd[cmd.index("--out") + 1])
            run_dir.mkdir(parents=True)
            recs = [{"step": i, "loss": 3.0, "tokens_per_s": 4 * 64 / 0.02} for i in range(1, 21)]
            (run_dir / "metrics.jsonl").write_text("\n".join(map(json.dumps, recs)))
            return 0, False, 10.0, "done"
        if title == "reference:eager:b4":  # cut by its timeout after 8 iterations
            text = "".join(f"iter {i}: loss 3.0, time 25.00ms\n" for i in range(8))
            return None, True, 30.0, text
        return 1, False, 10.0, "Traceback ...\nRuntimeError: boom"

    seen = []
    todo = [*e2e.plans((4,), nanogpt=False), e2e.Plan("llmkit", False, 8, "flash")]
    results = e2e.run_all(s, todo, deadline=100.0, log=tmp_path / "e2e.log",
                          on_result=lambda rs: seen.append([r.status for r in rs]),
                          runner=runner, say=lambda _: None)  # fmt: skip
    by = {r.key: r for r in results}
    assert by["llmkit-flash:eager:b4"].status == "ok"
    assert by["llmkit-flash:eager:b4"].ms_per_iter == pytest.approx(20.0)
    assert by["reference:eager:b4"].status == "partial"  # 8 iterations, 6 after warm-up
    assert by["reference:eager:b4"].ms_per_iter == pytest.approx(25.0)
    # t = 50 after three eager runs; a compiled run expects 90 s: not started, nor the rest
    assert by["llmkit-flash:compiled:b4"].status == "skipped"
    assert "not started" in by["llmkit-flash:compiled:b4"].reason
    assert by["llmkit-flash:eager:b8"].status == "ok"  # an eager run still fits
    assert len(seen) == len(todo) and seen[-1] == [r.status for r in results]
    assert [c[0] for c in calls] == [
        "llmkit-flash:eager:b4", "reference:eager:b4", "llmkit-sdpa:eager:b4",
        "llmkit-flash:eager:b8",
    ]  # fmt: skip
    table = e2e.markdown(results, s.shape, "cpu", s.warmup)
    assert "| llmkit (flash) | eager | 4 |" in table and "vs reference_gpt" in table
    assert "not run: llmkit-flash:compiled:b4" in table


def test_runs_that_cannot_run_say_why(tmp_path: Path):
    s = _setup(tmp_path, tmp_path / "missing.txt")
    s.nanogpt = tmp_path / "no-nanogpt"
    assert "no corpus" in e2e.blockers(e2e.Plan("llmkit", False, 4, "flash"), s)
    assert "no nanoGPT" in e2e.blockers(e2e.Plan("nanogpt", False, 4), s)
    (s.nanogpt).mkdir()
    (s.nanogpt / "train.py").write_text("")
    assert "meta.pkl" in e2e.blockers(e2e.Plan("nanogpt", False, 4), s)


def test_the_llmkit_spec_is_gpt2_small_in_bf16():
    import tomllib

    spec = tomllib.loads(e2e.llmkit_spec("c.txt", e2e.GPT2_SMALL, "cuda", 60, 12))
    m, t = spec["model"], spec["train"]
    assert (m["n_layers"], m["d_model"], m["n_heads"], m["max_seq_len"]) == (12, 768, 12, 1024)
    assert t["precision"] == "bf16" and t["log_interval"] == 1 and t["max_steps"] == 60
    assert spec["data"]["source"]["paths"] == ["c.txt"] and spec["data"]["sampling"] == "random"


# -- nanoGPT's data ---------------------------------------------------------------------------


def test_nanogpt_data_is_made_as_nanogpt_documents(tmp_path: Path):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20 + "Zé!"
    corpus = tmp_path / "input.txt"
    corpus.write_text(text, encoding="utf-8")
    info = nanogpt_data.prepare(corpus, tmp_path / "nanogpt")
    data = tmp_path / "nanogpt" / "data" / "shakespeare_char"
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    n = int(len(text) * 0.9)
    train = np.fromfile(data / "train.bin", dtype=np.uint16)
    val = np.fromfile(data / "val.bin", dtype=np.uint16)
    assert train.tolist() == [stoi[c] for c in text[:n]]
    assert val.tolist() == [stoi[c] for c in text[n:]]
    meta = pickle.loads((data / "meta.pkl").read_bytes())
    assert meta == {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}
    assert info["written"] == ["train.bin", "val.bin", "meta.pkl"]
    assert nanogpt_data.prepare(corpus, tmp_path / "nanogpt")["written"] == []


# -- the whole run, dry -----------------------------------------------------------------------

FAKE_TESTS = """
import pytest

def test_ok():
    pass

def test_also_ok():
    pass

def test_bad():
    assert 1 == 2

@pytest.mark.skip(reason="no GPU here")
def test_skipped():
    pass
"""


def _fake_tests(tmp_path: Path, body: str = FAKE_TESTS) -> Path:
    d = tmp_path / "fake_tests"
    d.mkdir()
    (d / "test_fake.py").write_text(body)
    return d


def test_a_dry_run_keeps_eight_files_and_counts_the_tests(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stray.txt").write_text("left over")  # would take a place among the 8
    code = gpu_run.main([
        "--dry-run", "--out", str(out), "--stages", "kernel_tests,gpu_tests",
        "--kernel-tests", str(_fake_tests(tmp_path)), "--gpu-tests", str(tmp_path / "none"),
        "--no-collect-only",
    ])  # fmt: skip
    assert code == 1  # a test failed
    names = sorted(p.name for p in out.iterdir())
    assert set(names) <= set(gpu_run.OUT_FILES) and len(names) <= 8
    data = json.loads((out / "summary.json").read_text())
    assert data["moved_out"] == ["stray.txt"]
    kt = data["tests"]["kernel_tests"]
    assert kt["status"] == "failed" and kt["counted_from"] == "junit"
    assert (kt["counts"]["passed"], kt["counts"]["failed"], kt["counts"]["skipped"]) == (2, 1, 1)
    assert any("test_bad" in line for line in kt["failed"])
    assert data["stages"]["gpu_tests"]["status"] == "absent"
    md = (out / "summary.md").read_text()
    assert "| kernel_tests | failed |" in md and "test_bad" in md
    assert "test_fake.py" in (out / "tests.log").read_text()


def test_a_stage_without_time_is_skipped_and_the_exit_says_so(tmp_path: Path):
    out = tmp_path / "out"
    code = gpu_run.main([
        "--dry-run", "--out", str(out), "--stages", "kernel_tests",
        "--kernel-tests", str(_fake_tests(tmp_path)), "--budget", "kernel_tests=2",
    ])  # fmt: skip
    assert code == 124
    data = json.loads((out / "summary.json").read_text())
    assert data["stages"]["kernel_tests"]["status"] == "skipped"


def test_sigterm_keeps_the_summary_and_ends_the_stage(tmp_path: Path):
    """The device tool's kill (or gpu_check.sh's timeout) in the middle of a stage: the
    summary says which stage was cut, and the stage's processes are gone."""
    slow = _fake_tests(tmp_path, "import time\n\ndef test_slow():\n    time.sleep(60)\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.scripts.gpu_run", "--dry-run", "--out", str(out),
           "--stages", "kernel_tests", "--kernel-tests", str(slow),
           "--no-collect-only"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    summary = out / "summary.json"
    while time.monotonic() - t0 < 60:
        if summary.is_file() and '"running"' in summary.read_text():
            break
        time.sleep(0.2)
    time.sleep(2.0)  # pytest is under way
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 1, output
    data = json.loads(summary.read_text())
    assert data["stages"]["kernel_tests"]["status"] == "killed"
    assert "stopped by SIGTERM" in (out / "run.log").read_text()
    assert time.monotonic() - t0 < 30
    leftover = subprocess.run(["pgrep", "-f", str(slow)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "the stage's pytest outlived the run"


@pytest.mark.skipif(sys.platform != "linux", reason="the GPU machine is Linux")
def test_the_training_commands_run_at_a_tiny_shape(tmp_path: Path):
    """The real e2e commands on the CPU (llmkit train with the written spec and the --set
    switches, reference_gpt's command line), eager, a few steps: their logs parse."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((ROOT / "README.md").read_text(encoding="utf-8")[:20000], encoding="utf-8")
    out = tmp_path / "out"
    code = gpu_run.main([
        "--dry-run", "--out", str(out), "--stages", "e2e", "--corpus", str(corpus),
        "--cache", str(tmp_path / "cache"), "--batches", "4",
    ])  # fmt: skip
    data = json.loads((out / "summary.json").read_text())
    by = {r["key"]: r for r in data["e2e"]}
    assert code == 0, (out / "e2e.log").read_text()[-3000:]
    for key in ("llmkit-flash:eager:b4", "llmkit-sdpa:eager:b4", "reference:eager:b4"):
        assert by[key]["status"] == "ok", by[key]
        assert by[key]["ms_per_iter"] > 0 and by[key]["timed"] >= e2e.MIN_TIMED
    assert "--set model.attention.name=sdpa" in by["llmkit-sdpa:eager:b4"]["command"]
    assert "| reference_gpt | eager | 4 |" in (out / "summary.md").read_text()
    assert os.listdir(out) and len(os.listdir(out)) <= 8


def test_the_kernel_tables_put_the_wanted_cases_first_and_compare_windows(tmp_path: Path):
    """gpu_check's plan: flash vs SDPA-flash forward+backward first, then the norm, then the
    sliding windows (each W) next to flash at the same N, with the TFLOP/s ratio."""
    from benchmarks.scripts import gpu_check

    code = gpu_check.main(["--dry-run", "--skip-checks", "--plots", "none", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    attention = data["benchmarks"]["attention"]
    assert {r["component"] for r in attention[:4]} == {"flash", "sdpa-flash"}
    assert all(r["mode"] == "fwd+bwd" for r in attention[:4])
    windows = {r["component"]: r["window"] for r in attention if r["component"].startswith("w")}
    assert windows == {f"window-{w}": w for w in gpu_check.DRY["windows"]}
    assert gpu_check.GPU["windows"][0] == 256 and max(gpu_check.GPU["windows"]) >= 512
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## Sliding window against flash" in md and "W=16 / flash TFLOP/s" in md
    assert not list(tmp_path.glob("*.png"))
    digest = gpu_run.tables_digest(tmp_path)
    assert digest["flash_vs_sdpa"] and digest["windows"] and digest["norm"]
    assert all(w["ratio"] is not None for w in digest["windows"])


def test_the_tune_stage_records_its_candidates_in_the_summary(tmp_path: Path):
    """``--stages tune``: flash_tune's dry run; its records land in summary.json (not in a
    file of their own: OUT holds 8), and a dry run hands no tiles to later stages."""
    out = tmp_path / "out"
    code = gpu_run.main(["--dry-run", "--out", str(out), "--stages", "tune"])
    assert code == 0
    data = json.loads((out / "summary.json").read_text())
    assert data["stages"]["tune"]["status"] == "ok"
    records = data["tune"]["records"]
    assert any(r["kind"] == "flash" and r["W"] for r in records)
    assert set(p.name for p in out.iterdir()) <= set(gpu_run.OUT_FILES)
