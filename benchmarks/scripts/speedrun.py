"""The shakespeare-char speedrun, side by side with the recipe it races.

For each seed, one after the other on the same machine: nanoGPT's CPU recipe as
``benchmarks/reference_gpt.py`` runs it (the same model, optimizer, schedule and batches as
nanoGPT's ``train.py``), nanoGPT's own ``train.py`` when ``--nanogpt DIR`` names a checkout
prepared with its ``data/shakespeare_char/prepare.py``, then ``llmkit train`` on the
speedrun spec. Every wall time is the whole command, process start to exit, measured from
here. The validation loss compared is the mean over every 64-token block of the validation
split (the last 10 % of the corpus): llmkit's final evaluation covers the whole split
(``train.eval_batches`` is larger than the split), the plain loop computes the same at its
end; nanoGPT reports its own 20-random-batch estimate.

    python -m benchmarks.scripts.speedrun --seeds 1 2 3 --nanogpt /tmp/nanogpt --json out.json

``--max-steps N`` shortens every run (quick mode, so the script cannot rot in CI).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "shakespeare-char-speedrun.toml"
DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
#: nanoGPT README's command for the CPU run ("I only have a macbook").
NANOGPT_ARGS = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--dropout=0.0",
]


@dataclass
class Result:
    who: str
    seed: int | None
    wall_s: float
    val_loss: float  # full validation split (nanoGPT: its 20-batch estimate)
    full_split: bool


def cpu_facts() -> dict[str, object]:
    """The CPU model, its matrix-relevant flags, torch's version and thread count."""
    import torch

    from llmkit.hardware import cpu_flags, cpu_name

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "flags": cpu_flags(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _timed(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"{' '.join(cmd[:4])} failed: {' | '.join(tail)}")
    return wall, done.stdout


def run_llmkit(seed: int, spec: Path, data: Path, out: Path, max_steps: int | None) -> Result:
    """``llmkit train`` on ``spec`` with ``train.seed = seed``; the final validation loss."""
    cmd = [sys.executable, "-m", "llmkit.cli", "train", str(spec), "--out", str(out)]
    cmd += ["--no-progress", "--set", f"train.seed={seed}"]
    cmd += ["--set", f"data.source.paths=[{json.dumps(str(data))}]"]
    if max_steps:
        cmd += ["--max-steps", str(max_steps), "--set", f"train.eval_interval={max_steps}"]
    # An empty shared data cache: every run loads, tokenizes and trains its tokenizer.
    env = {**os.environ, "LLMKIT_CACHE_DIR": str(out.with_name(f"{out.name}-cache"))}
    wall, _ = _timed(cmd, ROOT, env)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, lines) if "val_loss" in r]
    return Result("llmkit speedrun", seed, wall, evals[-1]["val_loss"], True)


def run_reference(seed: int, data: Path, max_steps: int | None) -> Result:
    """``benchmarks/reference_gpt.py`` (nanoGPT's recipe in plain PyTorch)."""
    cmd = [sys.executable, "-m", "benchmarks.reference_gpt", "--seed", str(seed)]
    cmd += ["--data", str(data)]
    if max_steps:
        cmd += ["--max-iters", str(max_steps)]
    wall, stdout = _timed(cmd, ROOT)
    result = json.loads(stdout.strip().splitlines()[-1])
    return Result("plain PyTorch recipe", seed, wall, result["full_val_loss"], True)


def run_nanogpt(checkout: Path, max_steps: int | None) -> Result:
    """nanoGPT's own ``train.py`` with its README's CPU command (its seed is fixed, so the
    script runs it once, beside the first seed)."""
    steps = max_steps or 2000
    args = [*NANOGPT_ARGS, f"--max_iters={steps}", f"--lr_decay_iters={steps}"]
    if max_steps:
        args.append(f"--eval_interval={steps}")
    with tempfile.TemporaryDirectory() as tmp:
        wall, stdout = _timed([sys.executable, "train.py", *args, f"--out_dir={tmp}"], checkout)
    val = re.findall(r"val loss ([0-9.]+)", stdout)
    return Result("nanoGPT train.py", None, wall, float(val[-1]), False)


def startup(data: Path, repeats: int) -> dict[str, list[float]]:
    """Start-up cost, side by side: the whole command for one optimizer step and one
    validation batch on a new run directory, ``repeats`` rounds of: llmkit with an empty
    shared data cache (``cold``: it loads the corpus, trains its tokenizer and tokenizes),
    llmkit again with what that run kept there (``warm``), then the plain loop."""
    walls: dict[str, list[float]] = {"llmkit cold": [], "llmkit warm": [], "plain PyTorch": []}
    ours = [
        sys.executable,
        "-m",
        "llmkit.cli",
        "train",
        str(ROOT / "specs" / "shakespeare-char.toml"),
    ]
    ours += ["--no-progress", "--no-sample", "--max-steps", "1"]
    for opt in ("train.eval_interval=1", "train.eval_batches=1", "train.plot=false"):
        ours += ["--set", opt]
    ours += ["--set", f"data.source.paths=[{json.dumps(str(data))}]"]
    plain = [sys.executable, "-m", "benchmarks.reference_gpt", "--data", str(data)]
    plain += ["--max-iters", "1", "--eval-iters", "1", "--no-full-split"]
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            env = {**os.environ, "LLMKIT_CACHE_DIR": f"{tmp}/cache-{i}"}
            for label in ("llmkit cold", "llmkit warm"):
                out = f"{tmp}/run-{i}-{label.split()[1]}"
                walls[label].append(_timed([*ours, "--out", out], ROOT, env)[0])
            walls["plain PyTorch"].append(_timed(plain, ROOT)[0])
    return walls


def summary(results: list[Result]) -> dict[str, dict[str, float]]:
    """Mean, min and max of wall time and validation loss per runner."""
    out: dict[str, dict[str, float]] = {}
    for who in dict.fromkeys(r.who for r in results):
        rs = [r for r in results if r.who == who]
        walls, vals = [r.wall_s for r in rs], [r.val_loss for r in rs]
        out[who] = {
            "runs": len(rs),
            "wall_mean": statistics.fmean(walls),
            "wall_min": min(walls),
            "wall_max": max(walls),
            "val_mean": statistics.fmean(vals),
            "val_min": min(vals),
            "val_max": max(vals),
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--spec", type=Path, default=SPEC)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--nanogpt", type=Path, help="a prepared nanoGPT checkout to run too")
    ap.add_argument("--no-reference", action="store_true", help="skip the plain loop")
    ap.add_argument("--max-steps", type=int, help="shorten every run (quick mode)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument(
        "--startup", type=int, metavar="N", help="only time start-up, N times each side"
    )
    args = ap.parse_args(argv)
    if args.startup:
        walls = startup(args.data.resolve(), args.startup)
        for who, ws in walls.items():
            print(f"{who:14} start-up: median {statistics.median(ws):.2f} s, min {min(ws):.2f} s")
        report = {"machine": cpu_facts(), "startup": walls}
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        return report
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            first = len(results)
            if not args.no_reference:
                results.append(run_reference(seed, args.data.resolve(), args.max_steps))
            if args.nanogpt and seed == args.seeds[0]:  # its seed is fixed: one run
                results.append(run_nanogpt(args.nanogpt, args.max_steps))
            out = Path(tmp) / f"run-{seed}"
            results.append(run_llmkit(seed, args.spec, args.data.resolve(), out, args.max_steps))
            for r in results[first:]:
                print(f"{r.who:22} seed {r.seed}: wall {r.wall_s:6.1f} s  val {r.val_loss:.4f}")
    report = {"machine": cpu_facts(), "results": [asdict(r) for r in results]}
    report["summary"] = summary(results)
    ours = report["summary"]["llmkit speedrun"]
    for who, s in report["summary"].items():
        ratio = ours["wall_mean"] / s["wall_mean"]
        print(
            f"{who:22} wall {s['wall_mean']:6.1f} s [{s['wall_min']:.1f}, {s['wall_max']:.1f}]"
            f"  val {s['val_mean']:.4f} [{s['val_min']:.4f}, {s['val_max']:.4f}]"
            f"  llmkit ÷ this {ratio:.2f}"
        )
    print(json.dumps(report["machine"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
