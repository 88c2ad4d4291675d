"""Scaling-law fits (llmkit.experiments.scaling, ``llmkit scaling``): approach 3 recovers
known exponents from synthetic data, its bootstrap intervals cover them, the compute-optimal
plan matches the closed form and a brute-force search, approach 2 recovers the IsoFLOP
exponent, and the readers take runs, sweep results and CSVs."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmkit import hookimpl
from llmkit.cli import main
from llmkit.cli import scaling as cli_scaling
from llmkit.errors import LlmkitError
from llmkit.experiments import scaling
from llmkit.experiments.scaling import Point
from llmkit.registry import reset_registry
from tests.helpers import registry_with, write_train_spec

pytestmark = pytest.mark.usefixtures("one_thread")

#: Hoffmann et al. 2022's fitted law (approach 3).
E, A, B, ALPHA, BETA = 1.69, 406.4, 410.7, 0.34, 0.28
N_GRID = np.logspace(6, 10, 6)
D_GRID = np.logspace(8, 12, 5)


def law(n: float, d: float) -> float:
    return E + A / n**ALPHA + B / d**BETA


def grid_points(noise: float, seed: int = 0, ns=N_GRID, ds=D_GRID) -> list[Point]:
    """The law on a grid of N × D, each loss times exp(ε), ε ~ N(0, noise²); C = 6ND."""
    rng = np.random.default_rng(seed)
    return [
        Point(n, d, 6 * n * d, law(n, d) * math.exp(rng.normal(0, noise)), f"g{i}")
        for i, (n, d) in enumerate((n, d) for n in ns for d in ds)
    ]


def rel(x: float, y: float) -> float:
    return abs(x / y - 1)


# -- approach 3 -----------------------------------------------------------------------------------


def test_noise_free_data_gives_the_law_back():
    fit = scaling.fit_loss_law(grid_points(0.0, ns=N_GRID[::2][:4], ds=D_GRID[::2]))  # 3 × 3
    fit4 = scaling.fit_loss_law(grid_points(0.0, ns=np.logspace(7, 10, 4), ds=D_GRID[:3]))
    for f in (fit, fit4):
        assert [rel(f.E, E), rel(f.alpha, ALPHA), rel(f.beta, BETA)] < [1e-6] * 3
        assert rel(f.A, A) < 1e-5 and rel(f.B, B) < 1e-5
        assert f.k == pytest.approx(6.0)
        assert f.rms_log_residual() < 1e-8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_data_recovers_the_exponents_within_5_percent(seed):
    fit = scaling.fit_loss_law(grid_points(0.005, seed))  # 6 N × 5 D, 0.5 % noise
    assert rel(fit.alpha, ALPHA) < 0.05
    assert rel(fit.beta, BETA) < 0.05
    assert rel(fit.E, E) < 0.05
    assert 0.003 < fit.rms_log_residual() < 0.007


def test_bootstrap_intervals_contain_the_true_values_and_plan_has_intervals():
    points = grid_points(0.005, seed=0)
    fit = scaling.fit_loss_law(points)
    boot = scaling.bootstrap(points, 30, seed=1, fit=fit)
    assert boot.samples.shape == (30, 5) and boot.failed == 0
    iv = boot.intervals(0.95)
    truth = {"E": E, "A": A, "B": B, "alpha": ALPHA, "beta": BETA, "a": BETA / (ALPHA + BETA)}
    for name, value in truth.items():
        lo, hi = iv[name]
        assert lo <= value <= hi, (name, lo, value, hi)
        assert lo <= {**fit.params(), "a": fit.a}[name] <= hi
    assert iv["alpha"][1] - iv["alpha"][0] < 0.1  # informative, not anything-goes
    plan = scaling.compute_optimal(fit, 1e22, boot=boot)
    for name in ("N", "D", "loss"):
        lo, hi = plan.intervals[name]
        assert lo < getattr(plan, name) < hi
    true_plan = scaling.compute_optimal(
        scaling.LawFit(E, A, B, ALPHA, BETA, 0.0, 1e-3, points), 1e22, k=6.0
    )
    assert plan.intervals["N"][0] < true_plan.N < plan.intervals["N"][1]


def test_compute_optimal_matches_the_closed_form_and_a_brute_force_search():
    fit = scaling.LawFit(E, A, B, ALPHA, BETA, 0.0, 1e-3, [], k=None)
    for flops, k in ((5.76e23, 6.0), (1e18, 7.3)):
        plan = scaling.compute_optimal(fit, flops, k=k)
        g = (ALPHA * A / (BETA * B)) ** (1 / (ALPHA + BETA))
        assert pytest.approx(g * (flops / k) ** (BETA / (ALPHA + BETA)), rel=1e-12) == plan.N
        assert pytest.approx((flops / k) ** (ALPHA / (ALPHA + BETA)) / g, rel=1e-12) == plan.D
        assert plan.N * plan.D * k == pytest.approx(flops, rel=1e-12)
        # brute force on the constraint curve D = C/(kN): a fine grid, then a refinement
        x = np.linspace(math.log(plan.N) - 5, math.log(plan.N) + 5, 200_001)
        losses = law(np.exp(x), flops / (k * np.exp(x)))
        best = x[np.argmin(losses)]
        assert abs(best - math.log(plan.N)) < 1e-4
        assert plan.loss == pytest.approx(losses.min(), rel=1e-9)
    assert scaling.compute_optimal(fit, 1e20).k == 6.0  # no FLOPs in the points: 6ND
    with pytest.raises(LlmkitError, match="no compute-optimal"):
        scaling.compute_optimal(scaling.LawFit(E, A, B, -0.1, BETA, 0, 1e-3, []), 1e20)


# -- approach 2 -----------------------------------------------------------------------------------


def isoflop_points(noise: float, seed: int = 0) -> list[Point]:
    """9 sizes per budget (×1/8 … ×8 around the true optimum, shifted by a per-budget factor
    so the grids are not centred), each point's C within ±2 % of its budget, D = C/(6N)."""
    rng = np.random.default_rng(seed)
    g = (ALPHA * A / (BETA * B)) ** (1 / (ALPHA + BETA))
    points = []
    for flops, shift in zip((1e18, 1e19, 1e20, 1e21), (1.5, 0.7, 1.3, 0.8), strict=True):
        n_opt = g * (flops / 6) ** (BETA / (ALPHA + BETA))
        for n in n_opt * shift * np.geomspace(1 / 8, 8, 9):
            c = flops * rng.uniform(0.98, 1.02)
            loss = law(n, c / (6 * n)) * math.exp(rng.normal(0, noise))
            points.append(Point(n, c / (6 * n), c, loss))
    return points


@pytest.mark.parametrize(("noise", "seed", "tol"), [(0.0, 0, 0.01), (0.002, 0, 0.05)])
def test_isoflop_minima_recover_the_exponent(noise, seed, tol):
    iso = scaling.isoflop_minima(isoflop_points(noise, seed), bootstrap=50, seed=seed)
    assert len(iso.groups) == 4 and not iso.skipped
    assert rel(iso.a, BETA / (ALPHA + BETA)) < tol
    assert rel(iso.b, ALPHA / (ALPHA + BETA)) < tol
    assert iso.a + iso.b == pytest.approx(1.0, abs=1e-6)  # k = 6 everywhere: D = C/(6N)
    for group in iso.groups:
        assert group.k == pytest.approx(6.0)
    lo, hi = iso.intervals()["a"]
    assert lo <= iso.a <= hi


def test_isoflop_groups_and_skips():
    points = isoflop_points(0.0)
    # a budget whose sizes all sit on one side of its minimum is skipped, with the reason
    g = (ALPHA * A / (BETA * B)) ** (1 / (ALPHA + BETA))
    n_opt = g * (1e22 / 6) ** (BETA / (ALPHA + BETA))
    lopsided = [
        Point(n, 1e22 / (6 * n), 1e22, law(n, 1e22 / (6 * n))) for n in n_opt * np.array([4, 8, 16])
    ]
    iso = scaling.isoflop_minima(points + lopsided)
    assert len(iso.groups) == 4 and "outside the sizes tried" in iso.skipped[0][1]
    # explicit groups, and a budget column, override the FLOP buckets
    keys = [round(math.log10(p.C)) for p in points]
    assert scaling.isoflop_minima(points, groups=keys).a == pytest.approx(iso.a)
    budgeted = [
        Point(p.N, p.D, None, p.loss, budget=10.0 ** round(math.log10(p.C))) for p in points
    ]
    assert len(scaling.group_by_flops(budgeted)) == 4
    with pytest.raises(LlmkitError, match="at least 2 compute budgets"):
        scaling.isoflop_minima(points[:9])


# -- readers --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[Path]:
    """Two tiny char-level runs of different widths and lengths."""
    tmp = tmp_path_factory.mktemp("scaling-runs")
    spec = write_train_spec(tmp / "spec", "the quick brown fox jumps over the lazy dog. " * 100)
    out = []
    for i, (width, steps) in enumerate(((16, 4), (32, 6))):
        run_dir = tmp / "runs" / f"run{i}"
        from llmkit.training import train

        train(
            spec,
            run_dir=run_dir,
            overrides=[
                f"model.d_model={width}",
                f"train.max_steps={steps}",
                "train.eval_interval=3",
                "train.log_interval=2",
            ],
            log=lambda _m: None,
            progress=False,
        )
        out.append(run_dir)
    return out


def test_points_from_runs_use_the_models_own_accounting(runs):
    from llmkit.model import build_model
    from llmkit.runs import open_run

    points = scaling.points_from_runs(runs)
    assert len(points) == 2
    for point, run_dir in zip(points, runs, strict=True):
        rs = open_run(run_dir).resolve()
        model = build_model(rs)  # on the CPU: the meta-device count must agree
        assert model.num_params(exclude_embeddings=True) == point.N
        assert model.num_params() > point.N
        records = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        evals = [r for r in records if "val_loss" in r]
        last_train = [r for r in records if "tokens" in r][-1]
        assert point.loss == evals[-1]["val_loss"]
        assert point.D == last_train["tokens"] == rs.spec.train.batch_size * 32 * last_train["step"]
        assert pytest.approx(model.flops_per_token(32)["train"] * point.D) == point.C
        assert point.source == str(run_dir)
    assert points[0].N < points[1].N
    # every evaluation: step 3 lies between logged steps 2 and 4, so its tokens interpolate
    evals = scaling.points_from_runs(runs[1:], all_evals=True)
    assert [p.source.rsplit("@", 1)[1] for p in evals] == ["3", "6"]
    assert evals[0].D == 3 * 4 * 32 and evals[1].D == 6 * 4 * 32
    # a directory of runs reads every run in it
    assert scaling.points_from_sources([runs[0].parent]) == points


def test_run_reader_errors(runs, tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(runs[0], run, ignore=shutil.ignore_patterns("checkpoints", "data"))
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([*lines, '{"step": 4, "val_loss": null}']) + "\n")
    with pytest.raises(LlmkitError, match="not finite"):
        scaling.points_from_runs([run])
    assert len(scaling.points_from_runs([run], all_evals=True)) == 2  # the null one skipped
    metrics.write_text("\n".join(x for x in lines if "val_loss" not in x) + "\n")
    with pytest.raises(LlmkitError, match="no validation loss"):
        scaling.points_from_runs([run])
    with pytest.raises(LlmkitError, match="not a run directory"):
        scaling.points_from_runs([tmp_path])


def test_points_from_a_sweep(tmp_path):
    rows = [
        {"trial": 0, "status": "done", "params": 9e9, "non_embedding_params": 1e6, "tokens": 2e7,
         "flops": 1.3e14, "final_val_loss": 3.1},
        {"trial": 1, "status": "failed", "non_embedding_params": 2e6, "tokens": 2e7,
         "flops": None, "final_val_loss": None},
        {"trial": 2, "status": "done", "non_embedding_params": 4e6, "tokens": 2e7,
         "flops": 5.1e14, "final_val_loss": 2.9},
    ]  # fmt: skip
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    points = scaling.points_from_sweep(sweep)
    assert [(p.N, p.D, p.C, p.loss, p.source) for p in points] == [
        (1e6, 2e7, 1.3e14, 3.1, "sweep/0"),
        (4e6, 2e7, 5.1e14, 2.9, "sweep/2"),
    ]
    assert scaling.points_from_sweep(sweep / "results.jsonl") == points
    assert scaling.points_from_sources([sweep]) == points
    with (tmp_path / "results.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    from_csv = scaling.points_from_sweep(tmp_path / "results.csv")
    assert [(p.N, p.C, p.loss, p.source) for p in from_csv] == [
        (1e6, 1.3e14, 3.1, f"{tmp_path.name}/0"),
        (4e6, 5.1e14, 2.9, f"{tmp_path.name}/2"),
    ]
    (sweep / "results.jsonl").write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(LlmkitError, match="no finished trials"):
        scaling.points_from_sweep(sweep)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LlmkitError, match="not a sweep directory"):
        scaling.points_from_sweep(tmp_path / "empty")


def test_points_from_csv_and_their_checks(tmp_path):
    path = tmp_path / "points.csv"
    path.write_text("N,D,loss\n1e6,1e8,3.5\n2e6,1e8,3.3\n")
    points = scaling.points_from_csv(path)
    assert [(p.N, p.D, p.C, p.loss) for p in points] == [
        (1e6, 1e8, None, 3.5),
        (2e6, 1e8, None, 3.3),
    ]
    assert points[0].flops == 6 * 1e6 * 1e8
    path.write_text("non_embedding_params,tokens,flops,Loss,label\n1e6,1e8,7e14,3.5,a\n")
    assert scaling.points_from_csv(path)[0] == Point(1e6, 1e8, 7e14, 3.5, "a")
    for body, message in (
        ("N,D\n1,2\n", "no column"),
        ("N,D,loss\n1e6,1e8,-3\n", "must be a finite number > 0"),
        ("N,D,loss\n1e6,nan,3\n", "must be a finite number > 0"),
        ("N,D,loss\n1e6,many,3\n", "not a number"),
        ("", "empty CSV"),
    ):
        path.write_text(body)
        with pytest.raises(LlmkitError, match=message):
            scaling.points_from_csv(path)
    with pytest.raises(LlmkitError, match="file not found"):
        scaling.points_from_csv(tmp_path / "missing.csv")


def test_too_few_points_are_refused():
    points = grid_points(0.0, ns=N_GRID[:2], ds=D_GRID[:2])  # 4 points
    with pytest.raises(LlmkitError, match="at least 5 points at distinct"):
        scaling.fit_loss_law(points)
    one_size = grid_points(0.0, ns=N_GRID[:1], ds=D_GRID)
    with pytest.raises(LlmkitError, match="1 sizes"):
        scaling.fit_loss_law(one_size)
    with pytest.raises(LlmkitError, match="finite number > 0"):
        scaling.fit_loss_law([*grid_points(0.0), Point(1e6, 1e8, None, math.inf)])


# -- the CLI --------------------------------------------------------------------------------------


class ScalingCommands:
    """Registers ``llmkit scaling`` as a plugin would, until the built-in plugin does."""

    distribution, name = "llmkit-scaling-test", "scaling-test"

    @hookimpl
    def register_commands(self, register):
        cli_scaling.register_commands(register)


@pytest.fixture
def cli(capsys):
    from llmkit.cli import builtin

    wired = cli_scaling in builtin.MODULES
    reset_registry(registry_with(*(() if wired else (ScalingCommands(),))))

    def run(*argv: str) -> tuple[int, str, str]:
        code = main([str(a) for a in argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    yield run
    reset_registry()


def write_csv(path: Path, points: list[Point]) -> Path:
    rows = ["N,D,C,loss"] + [
        ",".join(repr(float(v)) for v in (p.N, p.D, p.C, p.loss)) for p in points
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_cli_fit_and_plan(cli, tmp_path):
    data = write_csv(tmp_path / "iso.csv", isoflop_points(0.002))
    out = tmp_path / "fit" / "law.json"
    code, stdout, err = cli("scaling", "fit", data, "--bootstrap", "10", "--out", out)
    assert code == 0, err
    assert "approach 3" in stdout and "IsoFLOP minima" in stdout and "α" in stdout
    saved = json.loads(out.read_text())
    assert rel(saved["law"]["alpha"], ALPHA) < 0.1 and len(saved["points"]) == 36
    assert len(saved["bootstrap"]["samples"]) == 10 and saved["intervals"]["beta"][0] < BETA
    assert rel(saved["isoflop"]["a"], BETA / (ALPHA + BETA)) < 0.05
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    code, stdout, _ = cli("scaling", "plan", "--flops", "1e22", "--fit", out, "--json")
    assert code == 0
    plan = json.loads(stdout)["approach3"]
    fit, boot, _ = scaling.load_fit(out)
    expected = scaling.compute_optimal(fit, 1e22, boot=boot)
    assert plan["N"] == pytest.approx(expected.N) and plan["k"] == pytest.approx(6.0)
    assert plan["intervals"]["N"][0] <= plan["N"] <= plan["intervals"]["N"][1]
    assert "isoflop" in json.loads(stdout)
    code, stdout, _ = cli("scaling", "plan", "--flops", "1e24", "--fit", out)
    assert code == 0 and "compute-optimal" in stdout and "extrapolated" in stdout

    # --json prints the report; no plot on request; plan from sources directly
    code, stdout, _ = cli(
        "scaling", "fit", data, "--bootstrap", "0", "--out", tmp_path / "b.json", "--no-plot",
        "--json",
    )  # fmt: skip
    assert code == 0 and json.loads(stdout)["bootstrap"] is None
    assert not (tmp_path / "b.png").exists()
    code, stdout, _ = cli("scaling", "plan", "--flops", "1e20", data, "--bootstrap", "0")
    assert code == 0 and "no bootstrap" in stdout


def test_cli_errors_are_one_line(cli, tmp_path):
    few = write_csv(tmp_path / "few.csv", grid_points(0.0, ns=N_GRID[:2], ds=D_GRID[:2]))
    for argv, message in (
        (("scaling", "fit", few, "--out", tmp_path / "x.json"), "at least 5 points"),
        (("scaling", "fit", tmp_path / "nope.csv"), "not found"),
        (("scaling", "plan", "--flops", "1e20", "--fit", tmp_path / "nope.json"), "not found"),
        (("scaling", "plan", "--flops", "1e20"), "nothing to plan from"),
        (("scaling", "plan", "--flops", "1e20", "--fit", few), "not a scaling fit"),
    ):
        code, _, err = cli(*argv)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert message in err
    assert not (tmp_path / "x.json").exists()


def test_the_cli_module_imports_nothing_heavy():
    probe = (
        "import sys, llmkit.cli.scaling; "
        "heavy = [m for m in ('torch', 'scipy', 'numpy', 'matplotlib') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_meta_device_build_allocates_nothing(runs):
    from llmkit.model import build_model
    from llmkit.runs import open_run

    with torch.device("meta"):
        model = build_model(open_run(runs[1]).resolve())
    assert all(p.is_meta for p in model.parameters())


def test_cli_fit_says_how_many_bootstrap_refits_converged(cli, tmp_path):
    """6 points of 3 sizes × 2 token counts: most resamples lack 5 distinct (N, D) and are
    drawn again, up to 2n draws; the table's line says so, not only the JSON."""
    data = write_csv(tmp_path / "six.csv", grid_points(0.01, ns=N_GRID[:3], ds=D_GRID[:2]))
    out = tmp_path / "fit.json"
    code, stdout, err = cli("scaling", "fit", data, "--bootstrap", "20", "--out", out, "--no-plot")
    assert code == 0, err
    boot = json.loads(out.read_text())["bootstrap"]
    got, failed = boot["n"], boot["failed"]
    assert 0 < got < 20 and got + failed == 40
    assert f"{got} of 20 bootstrap refits converged ({failed} of 40 resamples failed" in stdout
    code, stdout, _ = cli("scaling", "plan", "--flops", "1e20", "--fit", out)
    assert code == 0 and f"note: the intervals rest on {got} of 20 bootstrap refits" in stdout
    # all converged: a plain count
    code, stdout, _ = cli(
        "scaling", "fit", write_csv(tmp_path / "grid.csv", grid_points(0.01)),
        "--bootstrap", "5", "--out", tmp_path / "g.json", "--no-plot",
    )  # fmt: skip
    assert code == 0 and "; 5 bootstrap refits" in stdout and "converged" not in stdout
