"""The one prepared GPU run (``bash benchmarks/scripts/gpu_check.sh [OUT] [--nanogpt PATH]``):
four stages, each with its own time budget, under one hard deadline, at most 8 files in OUT.

1. ``kernel_tests``: ``pytest tests/kernels`` (``-n`` workers when pytest-xdist is there:
   the Triton compiles run in parallel), 2. ``gpu_tests``: ``pytest tests/gpu`` (one
   process: some of it times things). Both ``-q -rfEs --durations=10``, a per-test timeout
   when pytest-timeout is there, output in ``tests.log``; counts from pytest's JUnit XML,
   else its summary line, else (a run cut short) its progress characters.
3. ``tables``: :mod:`benchmarks.scripts.gpu_check` (bf16 correctness of every Triton
   component against fp32 references, then the speed tables: flash vs SDPA-flash, the
   sliding window against flash, the Triton norm and ffn against PyTorch), resumed in a fresh
   process when a kernel breaks the CUDA context; ``gpu_check.md``, ``gpu_check.json``,
   ``gpu_check_attention.png``.
4. ``e2e``: :mod:`benchmarks.scripts.gpu_train_compare` (``llmkit train`` at GPT-2 small's
   shape next to reference_gpt and nanoGPT, eager and compiled); ``e2e.log``.

Time: a stage may run until the sum of its and the earlier stages' budgets has passed since
the start (what a stage leaves unused goes to the next), never past the deadline; a stage is
killed at its end and keeps what it measured. ``summary.md`` and ``summary.json`` are
rewritten at every stage's start and end, after each test directory, each tables attempt and
each training run, so a run cut short by the device tool keeps everything measured so far.
``run.log`` has this script's lines and gpu_check's output. Nothing else is left in OUT (a
stray file is moved out and named in the summary): the device tool brings back 8 files.

Exit status: 0 everything ran and passed; 1 a test, check or run failed; 2 no CUDA GPU;
124 time ran out before everything ran. ``--dry-run`` runs every stage on the CPU (pytest
``--collect-only``, gpu_check's dry run, the e2e commands at a tiny shape) in about a minute.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from benchmarks.scripts import gpu_train_compare as e2e

ROOT = e2e.ROOT
STAGES = ("kernel_tests", "gpu_tests", "tune", "tables", "e2e")
#: The stages run unless ``--stages`` says otherwise (``tune`` is asked for by name).
DEFAULT_STAGES = ("kernel_tests", "gpu_tests", "tables", "e2e")
#: Seconds per stage (the lead's plan: 1.5 + 1.5 + 2.5 + 2.5 minutes, a few seconds off each
#: for the start-up before the first stage and the last summary).
BUDGETS = {"kernel_tests": 85.0, "gpu_tests": 85.0, "tune": 100.0, "tables": 150.0, "e2e": 150.0}
#: Hard deadline of the whole run, from this script's start.
DEADLINE_S = 480.0
#: A stage with less than this many seconds left is not started.
MIN_START = {"kernel_tests": 15.0, "gpu_tests": 15.0, "tune": 30.0, "tables": 30.0, "e2e": 20.0}
TEST_DIRS = {"kernel_tests": "tests/kernels", "gpu_tests": "tests/gpu"}
#: Every file OUT may hold when the run ends (the device tool returns at most 8).
OUT_FILES = ("summary.md", "summary.json", "run.log", "tests.log", "gpu_check.md",
             "gpu_check.json", "gpu_check_attention.png", "e2e.log")  # fmt: skip
MAX_OUT_FILES = 8
TEST_TIMEOUT_S = 120  # per test, with pytest-timeout
TABLES_ATTEMPTS = 4
EXIT_RESUME = 3  # gpu_check.py: a kernel broke the CUDA context


class Stop(Exception):
    """SIGTERM or SIGINT: stop, keeping what was measured."""


# -- scheduling -------------------------------------------------------------------------------


def stage_end(
    stage: str, stages: tuple[str, ...], budgets: dict[str, float], start: float, deadline: float
) -> float:
    """When ``stage`` must end: ``start`` plus the budgets of the stages up to it (those that
    ran early leave their time to it), at the latest ``deadline``."""
    upto = stages[: stages.index(stage) + 1]
    return min(start + sum(budgets[s] for s in upto), deadline)


# -- pytest output ----------------------------------------------------------------------------

_COUNT_RE = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")
_PROGRESS_RE = re.compile(r"^(?:\S+\.py )?([.FEsxX]+)(?:\s+\[\s*\d+%\])?$")
_PROGRESS = {".": "passed", "F": "failed", "E": "errors", "s": "skipped", "x": "xfailed",
             "X": "xpassed"}  # fmt: skip
KEYS = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed")


def pytest_counts(text: str) -> tuple[dict[str, int], str]:
    """(counts, how): from pytest's last summary line (``3 failed, 120 passed, 5 skipped in
    40.1s``), else (a run cut short) from its ``-q`` progress characters; ``how`` says which
    ("summary", "progress", "none")."""
    counts = dict.fromkeys(KEYS, 0)
    for line in reversed(text.splitlines()):
        body = line.strip().strip("=").strip()
        if re.search(r"\bin [\d.]+s\b", body) and _COUNT_RE.search(body):
            for n, what in _COUNT_RE.findall(body):
                key = "errors" if what.startswith("error") else what
                if key in counts:
                    counts[key] = int(n)
            return counts, "summary"
        if re.search(r"\b(no tests ran|\d+ tests? collected)\b", body):
            m = re.search(r"(\d+) tests? collected", body)
            counts["collected"] = int(m.group(1)) if m else 0
            return counts, "summary"
    seen = False
    for line in text.splitlines():
        m = _PROGRESS_RE.match(line.strip())
        if m:
            seen = True
            for ch in m.group(1):
                counts[_PROGRESS[ch]] += 1
    return counts, ("progress" if seen else "none")


def junit_counts(path: Path) -> dict[str, int] | None:
    """Counts from a JUnit XML report (None if absent or unreadable)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    for suite in suites:
        for k in total:
            total[k] += int(suite.get(k, 0) or 0)
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"],
            "xfailed": 0, "xpassed": 0}  # fmt: skip


def pytest_notes(text: str, limit: int = 40) -> tuple[list[str], list[str]]:
    """(failed or errored test ids with their messages, skip reasons) from ``-rfEs``."""
    failed, skipped = [], []
    for line in text.splitlines():
        if line.startswith(("FAILED ", "ERROR ")) and len(failed) < limit:
            failed.append(line[:300])
        elif line.startswith("SKIPPED ") and len(skipped) < limit:
            skipped.append(line[:300])
    return failed, skipped


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def pytest_command(
    python: str, path: str, junit: Path, workers: int, collect_only: bool
) -> list[str]:
    cmd = [python, "-m", "pytest", path, "-q", "-rfEs", "--durations=10", f"--junitxml={junit}"]
    if collect_only:
        return [*cmd, "--collect-only"]
    if workers > 1 and has_module("xdist"):
        cmd += ["-n", str(workers)]
    if has_module("pytest_timeout"):
        cmd += ["--timeout", str(TEST_TIMEOUT_S)]
    return cmd


# -- the run ----------------------------------------------------------------------------------


class Run:
    """The stages' state, the summary files and the logs of one run."""

    def __init__(self, args: argparse.Namespace, out: Path, scratch: Path) -> None:
        self.args, self.out, self.scratch = args, out, scratch
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline
        self.stages: tuple[str, ...] = tuple(args.stages)
        self.tiles: Path | None = None
        self.budgets = dict(args.budgets)
        self.python = sys.executable
        self.data: dict[str, Any] = {
            "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "argv": sys.argv[1:],
            "dry_run": args.dry_run,
            "deadline_s": args.deadline,
            "environment": {},
            "stages": {s: {"status": "pending", "budget_s": self.budgets[s]} for s in self.stages},
            "tests": {},
            "tables": {},
            "e2e": [],
            "out_files": [],
            "moved_out": [],
        }

    # -- output --
    def say(self, line: str) -> None:
        print(line, flush=True)
        with (self.out / "run.log").open("a", encoding="utf-8") as fh:
            fh.write(line + "\n")

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.data["out_files"] = sorted(p.name for p in self.out.iterdir())
        tmp = self.scratch / "summary.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        shutil.move(tmp, self.out / "summary.json")
        tmp = self.scratch / "summary.md.tmp"
        tmp.write_text(summary_markdown(self.data))
        shutil.move(tmp, self.out / "summary.md")

    def tidy(self) -> None:
        """Move out of OUT whatever is not one of :data:`OUT_FILES` (a stray file would take a
        place among the 8 the device tool returns)."""
        moved = self.scratch / "moved-out"
        for p in sorted(self.out.iterdir()):
            if p.name in OUT_FILES and p.is_file():
                continue
            moved.mkdir(exist_ok=True)
            shutil.move(str(p), moved / p.name)
            self.data["moved_out"].append(p.name)

    # -- stages --
    def stage(self, name: str) -> dict[str, Any]:
        return self.data["stages"][name]

    def run_stage(self, name: str) -> None:
        st = self.stage(name)
        end = stage_end(name, self.stages, self.budgets, self.t0, self.deadline)
        left = end - time.monotonic()
        st["allotted_s"] = round(left, 1)
        if left < MIN_START[name]:
            st.update(status="skipped", detail=f"no time left ({max(left, 0):.0f} s)")
            self.say(f"== {name}: skipped, {max(left, 0):.0f} s left")
            self.save()
            return
        st["status"] = "running"
        self.say(f"== {name}: {left:.0f} s (t = {time.monotonic() - self.t0:.0f} s)")
        self.save()
        t = time.monotonic()
        try:
            if name in TEST_DIRS:
                self.tests(name, end)
            elif name == "tune":
                self.tune(end)
            elif name == "tables":
                self.tables(end)
            else:
                self.e2e(end)
        except Stop:
            st.update(status="killed", wall_s=round(time.monotonic() - t, 1))
            raise
        except Exception as exc:  # a bug here must not lose the other stages
            st.update(status="error", detail=f"{type(exc).__name__}: {exc}"[:300])
        st["wall_s"] = round(time.monotonic() - t, 1)
        self.say(f"== {name}: {st['status']} in {st['wall_s']:.0f} s; {st.get('detail', '')}")
        self.save()

    def tests(self, name: str, end: float) -> None:
        st = self.stage(name)
        path = getattr(self.args, name)
        if not (ROOT / path).exists():
            st.update(status="absent", detail=f"{path} does not exist")
            self.data["tests"][name] = {"path": path, "status": "absent"}
            return
        junit = self.scratch / f"{name}.xml"
        workers = self.args.test_workers if name == "kernel_tests" else 1
        cmd = pytest_command(self.python, path, junit, workers, self.args.collect_only)
        rc, timed_out, wall, output = e2e.run_process(
            cmd, ROOT, self.env(), end - time.monotonic(), self.out / "tests.log", path
        )
        counts, how = pytest_counts(output)
        from_junit = None if timed_out or self.args.collect_only else junit_counts(junit)
        if from_junit is not None:
            counts = {**counts, **from_junit}
            how = "junit"
        failed, skipped = pytest_notes(output)
        if timed_out:
            status = "timeout"
        elif rc == 0:
            status = "ok"
        elif rc == 1:
            status = "failed"
        elif rc == 5:
            status = "no tests"
        else:
            status = f"error (pytest exit {rc})"
        self.data["tests"][name] = {"path": path, "status": status, "rc": rc,
                                    "wall_s": round(wall, 1), "counts": counts,
                                    "counted_from": how, "failed": failed,
                                    "skipped": skipped, "command": " ".join(cmd)}  # fmt: skip
        brief = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        st.update(status=status, detail=f"{path}: {brief or 'nothing counted'} ({how})")

    def tune(self, end: float) -> None:
        """:mod:`benchmarks.scripts.flash_tune`: the fastest flash tiles here, handed to the
        later stages through ``LLMKIT_FLASH_TILES`` (the records go to the summary)."""
        st = self.stage("tune")
        tiles = self.scratch / "flash_tiles.json"
        budget = max(10.0, end - time.monotonic() - 20.0)
        cmd = [self.python, "-m", "benchmarks.scripts.flash_tune", "--out", str(self.scratch),
               "--budget", f"{budget:.0f}", "--tiles", str(tiles)]  # fmt: skip
        if self.args.dry_run:
            cmd.append("--dry-run")
        rc, timed_out, _wall, _ = e2e.run_process(
            cmd, ROOT, self.env(), end - time.monotonic(), self.out / "run.log", "tune"
        )
        records_file = self.scratch / "flash_tune.json"
        records = json.loads(records_file.read_text()) if records_file.exists() else []
        best = json.loads(tiles.read_text()) if tiles.exists() else {}
        self.data["tune"] = {"rc": rc, "records": records, "best": best}
        if best and not self.args.dry_run:
            self.tiles = tiles
        st.update(
            status="timeout" if timed_out else ("ok" if rc == 0 else f"error (exit {rc})"),
            detail=f"{len(records)} timings; best tiles {best}"[:300],
        )

    def tables(self, end: float) -> None:
        st = self.stage("tables")
        budget = max(10.0, end - time.monotonic() - 15.0)  # gpu_check's own benchmark budget
        attempts = []
        resume: list[str] = []
        for attempt in range(1, TABLES_ATTEMPTS + 1):
            left = end - time.monotonic()
            if left < 15:
                break
            cmd = [self.python, "-m", "benchmarks.scripts.gpu_check", "--out", str(self.out),
                   "--budget", f"{budget:.0f}", "--plots", "attention", *resume]  # fmt: skip
            if self.args.dry_run:
                cmd.append("--dry-run")
            rc, timed_out, wall, output = e2e.run_process(
                cmd, ROOT, self.env(), left, self.out / "run.log", f"tables, attempt {attempt}"
            )
            attempts.append({"rc": rc, "timed_out": timed_out, "wall_s": round(wall, 1)})
            tail = [ln for ln in output.splitlines() if ln.strip()][-25:]
            print("\n".join(tail), flush=True)
            self.data["tables"] = {"attempts": attempts, **tables_digest(self.out)}
            self.save()
            if rc == EXIT_RESUME or (rc is not None and rc < 0):  # broken context, a crash
                resume = ["--resume"]
                continue
            break
        last = attempts[-1] if attempts else {"rc": None, "timed_out": True}
        if last["timed_out"]:
            status = "timeout"
        elif last["rc"] == 0:
            status = "ok"
        elif last["rc"] in (1, EXIT_RESUME) or (last["rc"] or 0) < 0:
            status = "failed"
        else:
            status = f"error (exit {last['rc']})"
        digest = self.data["tables"]
        st.update(status=status, detail=digest.get("brief", ""))

    def e2e(self, end: float) -> None:
        st = self.stage("e2e")
        a = self.args
        dry = a.dry_run
        s = e2e.Setup(
            python=self.python, corpus=a.corpus, cache=Path(a.cache).resolve(),
            scratch=self.scratch / "e2e", device="cpu" if dry else "cuda",
            shape=e2e.DRY_SHAPE if dry else e2e.GPT2_SMALL,
            steps=min(a.steps, 6) if dry else a.steps, warmup=1 if dry else e2e.WARMUP,
            nanogpt=Path(a.nanogpt).resolve() if a.nanogpt else None,
        )  # fmt: skip
        s.scratch.mkdir(parents=True, exist_ok=True)
        batches = tuple(int(b) for b in a.batches.split(","))
        todo = e2e.plans(batches[:1] if dry else batches, s.nanogpt is not None,
                         compiled=not (dry or a.eager_only))  # fmt: skip

        def saved(results: list[e2e.Result]) -> None:
            self.data["e2e"] = [vars(r) for r in results]
            self.data["e2e_table"] = e2e.markdown(results, s.shape, s.device, s.warmup)
            self.save()

        results = e2e.run_all(s, todo, end, self.out / "e2e.log", saved, say=self.say)
        got = sum(r.status == "ok" for r in results)
        bad = [r.key for r in results if r.status in ("error", "timeout")]
        cut = sum(r.status == "skipped" and r.reason.startswith("not started") for r in results)
        st["status"] = "failed" if bad else ("partial" if cut else "ok")
        st["detail"] = (
            f"{got} of {len(results)} runs measured"
            + (f"; failed: {', '.join(bad)}" if bad else "")
            + (f"; {cut} not started (time)" if cut else "")
        )
        print(self.data.get("e2e_table", ""), flush=True)

    def env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("TRITON_INTERPRET", None)
        if self.tiles is not None:  # the tune stage's measured tiles
            env["LLMKIT_FLASH_TILES"] = str(self.tiles)
        return env

    def exit_status(self) -> int:
        stages = self.data["stages"].values()
        if any(st["status"] in ("failed", "error", "killed") or
               str(st["status"]).startswith("error") for st in stages):  # fmt: skip
            return 1
        if any(st["status"] in ("timeout", "skipped", "partial", "pending") for st in stages):
            return 124
        return 0


def tables_digest(out: Path) -> dict[str, Any]:
    """The headline of gpu_check.json: checks passed, benchmark records by status, flash vs
    SDPA-flash forward+backward speed by (D, N), the windows' TFLOP/s ratios to flash, the
    Triton norm's forward+backward speed at each token count."""
    try:
        data = json.loads((out / "gpu_check.json").read_text())
    except (OSError, ValueError):
        return {"brief": "no gpu_check.json"}
    checks = data.get("checks", [])
    failed = [f"{c['component']} {c['case']} {c['quantity']}: {c['error']:.3g} > "
              f"{c['tolerance']:.3g} {c.get('note', '')}".strip()
              for c in checks if not c["ok"]]  # fmt: skip
    benches = data.get("benchmarks", {})
    status: dict[str, int] = {}
    for records in benches.values():
        for r in records:
            status[r["status"]] = status.get(r["status"], 0) + 1
    ok = {(r["component"], r["mode"], r.get("head_dim"), r.get("seq_len") or r.get("tokens")): r
          for rs in benches.values() for r in rs if r["status"] == "ok"}  # fmt: skip
    flash = []
    for (comp, mode, d, n), r in sorted(ok.items(), key=lambda kv: str(kv[0])):
        if comp == "flash":
            base = ok.get(("sdpa-flash", mode, d, n))
            flash.append({"mode": mode, "D": d, "N": n, "tflops": r["tflops"],
                          "sdpa_tflops": base and base["tflops"],
                          "speedup": base and base["median_s"] / r["median_s"]})  # fmt: skip
    windows = []
    for (comp, mode, d, n), r in ok.items():
        if comp.startswith("window-"):
            f = ok.get(("flash", mode, d, n))
            windows.append({"W": int(comp.split("-")[1]), "mode": mode, "D": d, "N": n,
                            "tflops": r["tflops"], "flash_tflops": f and f["tflops"],
                            "ratio": f and r["tflops"] / f["tflops"]})  # fmt: skip
    norm = []
    for (comp, mode, _, n), r in ok.items():
        if comp == "rmsnorm_triton":
            base = ok.get(("rmsnorm", mode, None, n))
            norm.append({"mode": mode, "tokens": n, "gbps": r["gbps"],
                         "speedup": base and base["median_s"] / r["median_s"]})  # fmt: skip
    brief = (f"{len(checks) - len(failed)}/{len(checks)} comparisons pass; benchmarks: "
             + ", ".join(f"{v} {k}" for k, v in sorted(status.items())))  # fmt: skip
    return {"brief": brief, "checks": len(checks), "failed_checks": failed[:40],
            "missing": data.get("missing", []), "broken": data.get("state", {}).get("broken"),
            "bench_status": status, "flash_vs_sdpa": flash, "windows": windows,
            "norm": norm}  # fmt: skip


def _case_order(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["mode"] != "fwd+bwd", r.get("D") or 0, r.get("N") or 0)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}×"


def _n(v: float | None) -> str:
    return "-" if v is None else (f"{v:.3g}" if v < 100 else f"{v:,.0f}")


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]


def summary_markdown(d: dict[str, Any]) -> str:
    parts = ["# GPU run summary\n"]
    env = d.get("environment") or {}
    parts.append("\n".join(f"- {k}: {v}" for k, v in env.items()))
    parts.append(f"- started {d['started']}, {d.get('elapsed_s', 0):.0f} s so far; deadline "
                 f"{d['deadline_s']:.0f} s; dry run: {d['dry_run']}\n")  # fmt: skip
    parts.append("## Stages\n")
    rows = [[name, st["status"], f"{st['budget_s']:.0f}", st.get("allotted_s", "-"),
             st.get("wall_s", "-"), st.get("detail", "")]
            for name, st in d["stages"].items()]  # fmt: skip
    parts += _table(["stage", "status", "budget s", "allotted s", "wall s", "detail"], rows)
    if d["tests"]:
        parts.append("\n## Tests (tests.log has the output)\n")
        keys = list(KEYS)
        if any("collected" in t.get("counts", {}) for t in d["tests"].values()):
            keys.append("collected")
        rows = [[t["path"], t["status"], *(t.get("counts", {}).get(k, "-") for k in keys),
                 t.get("wall_s", "-"), t.get("counted_from", "-")]
                for t in d["tests"].values()]  # fmt: skip
        parts += _table(["directory", "status", *keys, "wall s", "counted from"], rows)
        for t in d["tests"].values():
            if t.get("failed"):
                parts.append(f"\nFailed in {t['path']}:\n")
                parts += [f"- `{line}`" for line in t["failed"]]
            if t.get("skipped"):
                parts.append(f"\nSkipped in {t['path']}:\n")
                parts += [f"- {line}" for line in t["skipped"][:15]]
    tb = d.get("tables") or {}
    if tb:
        parts.append("\n## Kernel tables (gpu_check.md has them all)\n")
        parts.append(tb.get("brief", "") + "\n")
        if tb.get("broken"):
            parts.append(f"Broke the CUDA context: {tb['broken']}\n")
        parts += [f"- FAIL {line}" for line in tb.get("failed_checks", [])[:20]]
        if tb.get("flash_vs_sdpa"):
            parts.append("\nflash vs SDPA-flash (speed = SDPA-flash time / flash time):\n")
            order = sorted(tb["flash_vs_sdpa"], key=_case_order)
            rows = [[r["mode"], r["D"], r["N"], _n(r["tflops"]), _n(r["sdpa_tflops"]),
                     _x(r["speedup"])] for r in order]  # fmt: skip
            head = ["mode", "D", "N", "flash TFLOP/s", "SDPA-flash TFLOP/s", "speed"]
            parts += _table(head, rows)
        if tb.get("windows"):
            parts.append("\nsliding window (TFLOP/s on attended pairs) vs flash at the same N:\n")
            order = sorted(tb["windows"], key=lambda r: (*_case_order(r), r["W"]))
            rows = [[r["W"], r["mode"], r["D"], r["N"], _n(r["tflops"]),
                     _n(r["flash_tflops"]), _x(r["ratio"])] for r in order]  # fmt: skip
            head = ["W", "mode", "D", "N", "window TFLOP/s", "flash TFLOP/s", "ratio"]
            parts += _table(head, rows)
        if tb.get("norm"):
            parts.append("\nrmsnorm_triton vs rmsnorm (PyTorch; speed = its time / ours):\n")
            order = sorted(tb["norm"], key=lambda r: (r["mode"] != "fwd+bwd", r["tokens"]))
            rows = [[r["mode"], r["tokens"], _n(r["gbps"]), _x(r["speedup"])] for r in order]
            parts += _table(["mode", "tokens", "GB/s", "speed"], rows)
    if d.get("e2e_table"):
        parts.append("\n## End to end (e2e.log has every run's output)\n")
        parts.append(d["e2e_table"])
    if d.get("moved_out"):
        parts.append("\nMoved out of OUT (over the file limit): " + ", ".join(d["moved_out"]))
    return "\n".join(parts) + "\n"


def environment(dry_run: bool) -> dict[str, Any]:
    import platform

    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda}  # fmt: skip
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    if not dry_run and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    env["datasets"] = datasets_status()
    env["xdist"] = has_module("xdist")
    return env


def datasets_status() -> str:
    """Whether ``import datasets`` works here (in a child: it takes seconds and pyarrow),
    with the versions it depends on; the end-to-end stage does not need it, tests/gpu does."""
    import importlib.metadata as md
    import subprocess

    versions = []
    for name in ("datasets", "pyarrow", "fsspec", "huggingface-hub"):
        try:
            versions.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            versions.append(f"{name} absent")
    if not has_module("datasets"):
        return "absent (" + ", ".join(versions) + ")"
    try:
        proc = subprocess.run([sys.executable, "-c", "import datasets"], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        state = "imports" if proc.returncode == 0 else f"import fails: {last}"
    except subprocess.TimeoutExpired:
        state = "import timed out"
    return f"{state} (" + ", ".join(versions) + ")"


def parse_budgets(items: list[str]) -> dict[str, float]:
    budgets = dict(BUDGETS)
    for item in items:
        for part in item.split(","):
            name, _, value = part.partition("=")
            if name.strip() not in budgets or not value:
                raise SystemExit(f"--budget {part!r}: expected STAGE=SECONDS, STAGE in {STAGES}")
            budgets[name.strip()] = float(value)
    return budgets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check", help="directory")
    ap.add_argument("--nanogpt", help="nanoGPT's checkout (train.py; data prepared or made)")
    ap.add_argument("--corpus", default=e2e.DEFAULT_CORPUS, help="corpus, relative to the repo")
    ap.add_argument("--cache", default=str(ROOT / e2e.CACHE), help="llmkit's token cache")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for everything")
    ap.add_argument("--budget", action="append", default=[], metavar="STAGE=S,...",
                    help=f"stage budgets (default {BUDGETS})")  # fmt: skip
    ap.add_argument(
        "--stages",
        default=",".join(DEFAULT_STAGES),
        help=f"comma list of {', '.join(STAGES)} (run in that order)",
    )
    ap.add_argument("--kernel-tests", dest="kernel_tests", default=TEST_DIRS["kernel_tests"])
    ap.add_argument("--gpu-tests", dest="gpu_tests", default=TEST_DIRS["gpu_tests"])
    ap.add_argument("--test-workers", type=int, default=4, help="pytest -n for tests/kernels")
    ap.add_argument("--collect-only", action=argparse.BooleanOptionalAction, default=None,
                    help="pytest only collects (default: with --dry-run)")  # fmt: skip
    ap.add_argument("--batches", default=",".join(map(str, e2e.BATCHES)))
    ap.add_argument("--steps", type=int, default=e2e.STEPS)
    ap.add_argument("--eager-only", action="store_true", help="e2e: no torch.compile runs")
    ap.add_argument("--dry-run", action="store_true", help="CPU: the logic, in about a minute")
    args = ap.parse_args(argv)
    args.budgets = parse_budgets(args.budget)
    if args.collect_only is None:
        args.collect_only = args.dry_run
    args.stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        print(f"error: unknown stages {unknown}; stages are {', '.join(STAGES)}", file=sys.stderr)
        return 2
    args.stages = [s for s in STAGES if s in args.stages]
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("error: gpu_check needs a CUDA GPU (torch.cuda.is_available() is False); "
                  "--dry-run runs its logic on the CPU", file=sys.stderr)  # fmt: skip
            return 2
    if args.nanogpt and not args.dry_run:
        _nanogpt_data(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-run-") as tmp:
        run = Run(args, out, Path(tmp))

        def stop(signum: int, _frame: Any) -> None:
            raise Stop(signal.Signals(signum).name)

        old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            run.data["environment"] = environment(args.dry_run)
            run.say(f"gpu_run: stages {', '.join(run.stages)}; deadline {args.deadline:.0f} s; "
                    f"budgets {run.budgets}")  # fmt: skip
            run.save()
            for name in run.stages:
                run.run_stage(name)
        except Stop as exc:
            run.say(f"gpu_run: stopped by {exc}")
        finally:
            e2e.kill_children()
            for s, handler in old.items():
                signal.signal(s, handler)
            run.tidy()
            run.save()
        run.say(f"gpu_run: done in {time.monotonic() - run.t0:.0f} s; files in {out}: "
                f"{', '.join(run.data['out_files'])}")  # fmt: skip
        return run.exit_status()


def _nanogpt_data(args: argparse.Namespace) -> None:
    """nanoGPT's data files from the corpus when they are missing (prepared here, it needs no
    network and no datasets)."""
    from benchmarks.scripts import nanogpt_data

    data = Path(args.nanogpt) / "data" / nanogpt_data.DATASET
    corpus = ROOT / args.corpus
    if not (data / "train.bin").is_file() and corpus.is_file():
        print(nanogpt_data.prepare(corpus, args.nanogpt))


if __name__ == "__main__":
    sys.exit(main())
