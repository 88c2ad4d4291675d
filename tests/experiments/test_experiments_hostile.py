"""Hostile and malformed sweep and search files and options: each is refused in one line
(``error: ...``, exit 2, no traceback), in bounded time and memory, before anything is made
(no sweep or search directory).

- sweep sizes are counted from the axes' lengths before anything is expanded, and capped
  (:data:`MAX_TRIALS`);
- a search checks its parameters' combinations, not only each end alone: the largest model
  the parameters give must fit this machine's memory, and each trial is checked as it starts;
  checking a model never builds large tables on the CPU;
- every unusable ``storage`` URL (``--storage`` or the file's) is one line, checked before the
  search's directory is made;
- ranges that overflow a float, steps too small to count, integers beyond 64 bits, seeds
  NumPy cannot take, ``base`` naming no spec file (NUL bytes, a directory, a program).

Every file here is written by the test itself.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from llmkit.cli import main
from llmkit.errors import LlmkitError, SpecError
from llmkit.experiments import search as search_mod
from llmkit.experiments import trial as trial_runner
from llmkit.experiments.distributions import MAX_CHOICES
from llmkit.experiments.search import run_search, storage_problem
from llmkit.experiments.sweep_axes import (
    MAX_AXIS_VALUES,
    MAX_TRIALS,
    SweepFile,
    expand,
    read_sweep,
    trial_count,
)
from tests.helpers import write_train_spec

CORPUS = "the quick brown fox jumps over the lazy dog. " * 60
#: The address space a subprocess gets: torch imports in it, no model's weights fit.
SUBPROCESS_BYTES = 4 * 2**30


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A tiny char-level spec (d_model 32, 2 layers, RoPE) beside the files under test."""
    return write_train_spec(tmp_path, CORPUS, max_steps=4, eval_interval=2, log_interval=1)


def one_line_error(err: str) -> str:
    """The single ``error:`` line of a refused command (nothing else on stderr)."""
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], out: Path | None = None) -> str:
    """Run ``llmkit ARGV`` in-process: exit 2, one line; ``out`` (a directory) not made."""
    capsys.readouterr()
    assert main(argv) == 2
    line = one_line_error(capsys.readouterr().err)
    if out is not None:
        assert not out.exists()
    return line


def refused_subprocess(argv: list[str], cwd: Path, timeout: float = 120) -> str:
    """Run ``llmkit ARGV`` in a process limited to :data:`SUBPROCESS_BYTES` of address space
    (an allocation beyond it would be a MemoryError and a traceback): exit 2, one line."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (SUBPROCESS_BYTES, SUBPROCESS_BYTES))

    proc = subprocess.run(
        [sys.executable, "-m", "llmkit.cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    return one_line_error(proc.stderr)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- (b) sweep sizes, counted before anything is expanded -----------------------------------------

RANGE = "{ linear = [0.0, 1.0], num = 10000 }"
LONG_LIST = "[" + ", ".join(str(i) for i in range(3000)) + "]"
HUGE_SWEEPS = {
    # several axes of 10^4 values: 10^12 trials
    "ranges": f'[axes]\n"optimizer.lr" = {RANGE}\n"train.grad_clip" = {RANGE}\n'
    f'"model.dropout" = {RANGE}\n',
    # long lists: 2.7 · 10^10
    "lists": f'[axes]\n"train.seed" = {LONG_LIST}\n"data.seed" = {LONG_LIST}\n'
    f'"train.batch_size" = {LONG_LIST}\n',
    # the most seeds a count gives, times a long axis: 10^8
    "seeds": f'seeds = 10000\n[axes]\n"optimizer.lr" = {RANGE}\n',
    # zip groups count once each, but multiply: 10^8
    "zip": f'[[zip]]\n"optimizer.lr" = {RANGE}\n"train.grad_clip" = {RANGE}\n'
    f'[[zip]]\n"model.dropout" = {RANGE}\n"data.seed" = {RANGE}\n',
    # random samples times seeds: 10^8
    "random": "\nseeds = 10000\n[random]\nsamples = 10000\n[random.axes]\n"
    '"optimizer.lr" = { log_uniform = [1e-4, 1e-2] }\n',
}


@pytest.mark.parametrize("kind", sorted(HUGE_SWEEPS))
def test_a_sweep_too_large_is_refused_before_anything_is_expanded(
    kind: str, tmp_path: Path, base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "huge.toml", 'base = "spec.yaml"\n' + HUGE_SWEEPS[kind])
    out = tmp_path / "out"
    tracemalloc.start()
    started = time.monotonic()
    try:
        for argv in (["sweep", str(path), "--dry-run"], ["sweep", str(path), "--out", str(out)]):
            line = refused(argv, capsys, out)
            assert f"more than the limit of {MAX_TRIALS:,}" in line
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 30
    assert peak < 200 * 2**20  # the file's values, not its trials
    with pytest.raises(SpecError) as caught:
        read_sweep(path)
    (problem,) = caught.value.problems
    count = int(problem.split(" trials ")[0].removeprefix("the sweep has ").replace(",", ""))
    assert count > MAX_TRIALS and f"{count:,}" in line  # the count, named exactly


def test_the_trial_count_names_each_factor(tmp_path: Path, base: Path, capsys) -> None:
    path = write(
        tmp_path / "huge.toml",
        f'base = "spec.yaml"\nseeds = 3\n[axes]\n"optimizer.lr" = {RANGE}\n'
        '"model.n_heads" = [1, 2]\n',
    )
    line = refused(["sweep", str(path), "--dry-run"], capsys)
    assert "the sweep has 60,000 trials (10,000 optimizer.lr × 2 model.n_heads × 3 seeds)" in line


def test_the_cap_is_counted_exactly(tmp_path: Path, base: Path) -> None:
    """10,000 trials are allowed, 10,001 refused; integer ranges count the values they keep
    (repeats dropped), zip groups once."""
    at_cap = SweepFile.model_validate(
        {
            "base": "spec.yaml",
            "axes": {"optimizer.lr": {"log": [1e-4, 1e-2], "num": 100}},
            "zip": [{"train.grad_clip": list(range(100)), "data.seed": list(range(100))}],
        }
    )
    assert trial_count(at_cap) == MAX_TRIALS == len(expand(at_cap))
    # 10,000 requested integers between 1 and 10 keep 10
    dedup = SweepFile.model_validate(
        {
            "base": "spec.yaml",
            "axes": {
                "model.n_layers": {"linear": [1, 10], "num": MAX_AXIS_VALUES, "integer": True},
                "optimizer.lr": {"linear": [0.001, 0.01], "num": 1000},
            },
        }
    )
    assert trial_count(dedup) == 10 * 1000
    with pytest.raises(ValueError, match="10,001 trials"):
        SweepFile.model_validate(
            {"base": "spec.yaml", "axes": {"a.b": list(range(73)), "c.d": list(range(137))}}
        )


def test_expand_counts_before_it_expands_a_model_built_without_validation() -> None:
    sweep = SweepFile.model_construct(
        name=None,
        base="spec.yaml",
        overrides=[],
        seeds=list(range(MAX_AXIS_VALUES)),
        axes={"optimizer.lr": list(range(MAX_AXIS_VALUES))},
        zipped=[],
        random=None,
        branch_budgets=False,
    )
    with pytest.raises(LlmkitError, match="100,000,000 trials"):
        expand(sweep)


def test_a_huge_sweep_is_one_line_in_a_process_with_little_memory(tmp_path: Path, base: Path):
    path = write(tmp_path / "huge.toml", 'base = "spec.yaml"\n' + HUGE_SWEEPS["ranges"])
    line = refused_subprocess(["sweep", str(path), "--dry-run"], tmp_path)
    assert "1,000,000,000,000 trials" in line
    line = refused_subprocess(["sweep", str(path), "--out", "out"], tmp_path)
    assert not (tmp_path / "out").exists()


def test_long_values_times_many_trials_are_refused_before_they_are_written(
    tmp_path: Path, base: Path, capsys
) -> None:
    """Two 1 MB names on an axis beside 5,000 learning rates: 10 GB of overrides once every
    trial's are written; and a 100 kB --set given to each of 10,000 trials, 1 GB."""
    name = "x" * 2**20
    path = write(
        tmp_path / "long.toml",
        f'base = "spec.yaml"\n[axes]\n"name" = ["{name}", "{name}y"]\n'
        '"optimizer.lr" = { linear = [0.001, 0.01], num = 5000 }\n',
    )
    out = tmp_path / "out"
    tracemalloc.start()
    try:
        line = refused(["sweep", str(path), "--out", str(out)], capsys, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "10,000 trials would hold about 10,0" in line and "limit of 64 MiB" in line
    assert peak < 200 * 2**20
    path = write(tmp_path / "many.toml", f'base = "spec.yaml"\n[axes]\n"optimizer.lr" = {RANGE}\n')
    argv = ["sweep", str(path), "--dry-run", "--set", "name=" + "z" * 100_000]
    assert "more than the limit of 64 MiB" in refused(argv, capsys)


def test_repeated_seeds_are_named_alone(tmp_path: Path, base: Path, capsys) -> None:
    seeds = ", ".join(["7"] * 5000)
    path = write(tmp_path / "s.toml", f'base = "spec.yaml"\nseeds = [{seeds}]\n')
    line = refused(["sweep", str(path), "--dry-run"], capsys)
    assert line.endswith("seeds: seeds must be distinct; 7 appears twice") and len(line) < 300


# -- hostile values: ranges, steps, integers, types, keys -----------------------------------------

BAD_SWEEPS = {
    "nan in a range": ('[axes]\n"optimizer.lr" = { linear = [nan, 1.0], num = 3 }', "finite"),
    "inf in a range": ('[axes]\n"optimizer.lr" = { log = [1e-3, inf], num = 3 }', "finite"),
    "num 0": ('[axes]\n"optimizer.lr" = { log = [1e-3, 1e-2], num = 0 }', "greater than"),
    "num < 0": ('[axes]\n"optimizer.lr" = { linear = [0, 1], num = -5 }', "greater than"),
    "num huge": (
        '[axes]\n"optimizer.lr" = { linear = [0, 1], num = 9223372036854775807 }',
        f"less than or equal to {MAX_AXIS_VALUES}",
    ),
    "num float": ('[axes]\n"optimizer.lr" = { linear = [0, 1], num = 2.5 }', "integer"),
    "log from 0": ('[axes]\n"optimizer.lr" = { log = [0, 1e-2], num = 3 }', "values > 0"),
    "log from < 0": ('[axes]\n"optimizer.lr" = { log = [-1, 1e-2], num = 3 }', "values > 0"),
    "linear overflow": (
        '[axes]\n"optimizer.lr" = { linear = [-1.7e308, 1.7e308], num = 3 }',
        "wider than a float holds",
    ),
    "uniform overflow": (
        '[random]\nsamples = 2\n[random.axes]\n"optimizer.lr" = { uniform = [-1.7e308, 1.7e308] }',
        "wider than a float holds",
    ),
    "step too small": (
        "[random]\nsamples = 2\n[random.axes]\n"
        '"optimizer.lr" = { uniform = [0.0, 1.0], step = 5e-324 }',
        "too small for the range",
    ),
    "seed count huge": ('seeds = 9223372036854775807\n[axes]\n"a.b" = [1]', "seed count"),
    "seed count < 0": ('seeds = -3\n[axes]\n"a.b" = [1]', "seed count"),
    "seeds a string": ('seeds = "3"\n[axes]\n"a.b" = [1]', "seeds"),
    "axes a string": ('axes = "x"', "axes"),
    "axes a list": ("axes = [1]", "axes"),
    "axis a scalar": ('[axes]\n"optimizer.lr" = 1e-3', "an axis is a list"),
    "axis empty": ('[axes]\n"optimizer.lr" = []', "at least 1"),
    "axis path empty": ('[axes]\n"" = [1]', "not a spec path"),
    "unknown key": ('foo = 3\n[axes]\n"a.b" = [1]', "unknown key"),
    "unknown range key": (
        '[axes]\n"optimizer.lr" = { log = [1e-3, 1e-2], num = 3, foo = 1 }',
        "unknown key",
    ),
    "zip a table": ("zip = {a = 1}", "zip"),
    "random a number": ("random = 5", "random"),
    "set a string": ('set = "x"\n[axes]\n"a.b" = [1]', "set"),
    "metric a number": ('metric = 3\n[axes]\n"a.b" = [1]', "metric"),
    "nested arrays": ("x = " + "[" * 5000 + "]" * 5000, "nested more than"),
    "nested tables": ("x = " + "{a=" * 5000 + "1" + "}" * 5000, "nested more than"),
    "too many choices": (
        '[random]\nsamples = 2\n[random.axes]\n"a.b" = { choice = ['
        + ", ".join(["1"] * (MAX_CHOICES + 1))
        + "] }",
        f"at most {MAX_CHOICES}",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SWEEPS))
def test_hostile_sweep_files_are_one_line(case: str, tmp_path: Path, base: Path, capsys) -> None:
    body, message = BAD_SWEEPS[case]
    path = write(tmp_path / "bad.toml", f'base = "spec.yaml"\n{body}\n')
    out = tmp_path / "out"
    assert message in refused(["sweep", str(path), "--dry-run"], capsys)
    assert message in refused(["sweep", str(path), "--out", str(out)], capsys, out)


BAD_YAML = {
    "int beyond 64 bits": (
        "random:\n  samples: 2\n  axes:\n    train.max_steps: {int: [1, " + "9" * 400 + "]}\n",
        "within [-2**63, 2**63)",
    ),
    "log int beyond a float": (
        "random:\n  samples: 2\n  axes:\n    train.max_steps: {int: [1, "
        + "9" * 400
        + "], log: true}\n",
        "within [-2**63, 2**63)",
    ),
    "num beyond 64 bits": (
        "axes:\n  optimizer.lr: {linear: [0.0, 1.0], num: " + "9" * 50 + "}\n",
        "less than or equal to",
    ),
    "seed beyond 64 bits": ("seeds: [" + "9" * 40 + "]\naxes:\n  a.b: [1]\n", "2**63"),
    "nested": ("x: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than"),
    "a date": ("axes:\n  optimizer.lr: [2020-01-01]\n", "not a value a spec holds"),
    "a key not a string": ("axes:\n  5: [1]\n", "string"),
    "a list at the top": ("- 1\n- 2\n", "table/mapping"),
}


@pytest.mark.parametrize("case", sorted(BAD_YAML))
def test_hostile_yaml_sweep_files_are_one_line(case, tmp_path: Path, base: Path, capsys):
    body, message = BAD_YAML[case]
    text = body if case == "a list at the top" else f"base: spec.yaml\n{body}"
    path = write(tmp_path / "bad.yaml", text)
    assert message in refused(["sweep", str(path), "--dry-run"], capsys)


BAD_BASES = {
    "a NUL byte": ('"a\\u0000b"', "not a path to a spec file"),
    "a directory": ('"."', "no spec file"),
    "no such user": ('"~no-such-user-llmkit/spec.yaml"', "base"),
    "a name too long": ('"' + "a" * 5000 + '"', "not a path to a spec file"),
    "a program": ('"run.py"', "unknown spec format"),
    "not text": ('"blob.yaml"', "not UTF-8"),
    "empty": ('""', "at least 1 character"),
    "a number": ("5", "valid string"),
    "/dev/null": ('"/dev/null"', "no spec file"),
}


@pytest.mark.parametrize("case", sorted(BAD_BASES))
@pytest.mark.parametrize("command", ["sweep", "search"])
def test_a_base_that_is_no_spec_file_is_one_line(case, command, tmp_path: Path, capsys):
    (tmp_path / "run.py").write_text("print('hello')\n")
    (tmp_path / "blob.yaml").write_bytes(bytes(range(256)) * 4)
    value, message = BAD_BASES[case]
    if command == "sweep":
        text = f'base = {value}\n[axes]\n"optimizer.lr" = [1e-3, 1e-2]\n'
    else:
        text = f'name = "s"\nbase = {value}\n[params]\n"optimizer.lr" = {{ uniform = [0.1, 1] }}\n'
    path = write(tmp_path / f"{command}.toml", text)
    out = tmp_path / "out"
    assert message in refused([command, str(path), "--out", str(out)], capsys, out)


# -- (e) a search's combinations, and the memory a trial's model needs ----------------------------


def search_file(tmp_path: Path, body: str, name: str = "search.toml") -> Path:
    return write(tmp_path / name, f'name = "hostile"\nbase = "spec.yaml"\n{body}')


WIDE_AND_DEEP = (
    '[params]\n"model.d_model" = { int = [64, 4096], step = 64 }\n'
    '"model.n_layers" = { int = [1, 64] }\n"optimizer.lr" = { log_uniform = [1e-4, 1e-2] }\n'
)


def test_search_refuses_the_combination_no_single_end_shows(
    tmp_path: Path, base: Path, capsys, monkeypatch
) -> None:
    """d_model 4096 alone (2 layers: 0.4e9 parameters, 1.6 GB) and 64 layers alone (width 32)
    fit an 8 GiB machine; both together (1.3e10 parameters, 51 GB) do not: refused before
    the search's directory is made, without building it."""
    monkeypatch.setattr(trial_runner, "machine_memory", lambda: 8 * 2**30)
    built: list[int] = []
    real_build = trial_runner.model_problems

    def watched(rs):
        built.append(trial_runner.model_size(rs))
        return real_build(rs)

    monkeypatch.setattr(trial_runner, "model_problems", watched)
    import llmkit.model

    real_meta = llmkit.model.build_on_meta

    def small_on_meta(rs):
        assert trial_runner.model_size(rs) < 10**10, "the refused model was built"
        return real_meta(rs)

    monkeypatch.setattr(llmkit.model, "build_on_meta", small_on_meta)
    path = search_file(tmp_path, WIDE_AND_DEEP)
    out = tmp_path / "out"
    line = refused(["search", str(path), "--out", str(out)], capsys, out)
    assert "model.d_model = 4096, model.n_layers = 64" in line and "(the largest model)" in line
    assert "more than this machine's memory (8.0 GiB)" in line and "GiB of fp32 weights" in line
    assert max(built) > 10**10  # checked, and refused by its size, not built


def test_search_reports_a_single_end_too_large_for_the_machine(
    tmp_path: Path, base: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setattr(trial_runner, "machine_memory", lambda: 2**30)
    path = search_file(tmp_path, WIDE_AND_DEEP)
    line = refused(["search", str(path), "--out", str(tmp_path / "out")], capsys)
    assert "model.d_model = 4096: model: about" in line and "(1.0 GiB)" in line


def test_search_corners_are_checked_when_every_end_passes(tmp_path: Path, base: Path, capsys):
    """Each end resolves alone (4 heads at the base width 32, width 34 with the base's 2
    heads), their low corner does not (34 is not divisible by 4): one line, nothing made."""
    path = search_file(
        tmp_path,
        """set = ['model.position={ name = "learned" }']\n"""
        '[params]\n"model.n_heads" = { choice = [4, 2] }\n'
        '"model.d_model" = { choice = [34, 64] }\n',
    )
    out = tmp_path / "out"
    line = refused(["search", str(path), "--out", str(out)], capsys, out)
    assert "model.n_heads = 4, model.d_model = 34 (every parameter at its low end)" in line
    assert "divisible" in line


def test_a_large_search_is_one_line_in_a_process_with_little_memory(tmp_path: Path, base: Path):
    """Without any stand-in: d_model 4096 with 1024 layers would be 2e11 parameters (800 GB)."""
    path = search_file(
        tmp_path,
        '[params]\n"model.d_model" = { int = [64, 4096], step = 64 }\n'
        '"model.n_layers" = { int = [1, 1024] }\n',
    )
    line = refused_subprocess(["search", str(path), "--out", "out"], tmp_path, timeout=300)
    assert "more than this machine's memory" in line
    assert not (tmp_path / "out").exists()


def test_a_trial_too_large_for_the_machine_fails_without_starting(
    tmp_path: Path, base: Path, monkeypatch
) -> None:
    """The check as each trial starts (a combination the checks before it did not try): the
    trial fails with the reason, no training process starts, the study stops."""
    monkeypatch.setattr(search_mod, "check_search", lambda *a, **k: None)
    monkeypatch.setattr(trial_runner, "machine_memory", lambda: 1024)

    def no_process(job, *args, **kwargs):
        raise AssertionError(f"a trial process started: {job}")

    monkeypatch.setattr(trial_runner, "run_trial", no_process)
    path = search_file(tmp_path, 'trials = 2\n[params]\n"optimizer.lr" = { uniform = [0.1, 1] }\n')
    lines: list[str] = []
    result = run_search(path, out=tmp_path / "out", log=lines.append)
    assert [r["state"] for r in result.rows] == ["FAIL", "FAIL"]
    assert all("more than this machine's memory" in r["error"] for r in result.rows)
    assert any(line.startswith("study stopped: 2 trials failed") for line in lines)


def test_checking_a_model_builds_large_tables_on_the_meta_device(
    tmp_path: Path, base: Path, capsys, monkeypatch
) -> None:
    """A small estimate but a 2^20 × 1024 sinusoidal table (21 GB and 90 s to build on the
    CPU): built on the meta device, so a sweep's check takes no memory."""
    import torch

    import llmkit.model.transformer as transformer

    real_build = transformer.build_model

    def meta_only(rs):
        assert torch.empty(0).device.type == "meta", "built on the CPU"
        return real_build(rs)

    monkeypatch.setattr(transformer, "build_model", meta_only)
    path = write(
        tmp_path / "long.toml",
        'base = "spec.yaml"\nset = ["model.max_seq_len=1048576", "model.d_model=1024", '
        '"model.n_layers=1", "model.n_heads=8"]\n'
        '[axes]\n"model.position" = [{ name = "sinusoidal" }, { name = "learned" }]\n',
    )
    started = time.monotonic()
    capsys.readouterr()
    assert main(["sweep", str(path), "--dry-run"]) == 0
    assert "2 trials, all valid" in capsys.readouterr().out
    assert time.monotonic() - started < 60


def test_a_sweep_checks_its_long_tables_in_a_process_with_little_memory(tmp_path, base):
    path = write(
        tmp_path / "long.toml",
        'base = "spec.yaml"\nset = ["model.max_seq_len=1048576", "model.d_model=1024", '
        '"model.n_layers=1", "model.position={ name = \\"sinusoidal\\" }"]\n'
        '[axes]\n"model.n_heads" = [8, 3]\n',
    )
    line = refused_subprocess(["sweep", str(path), "--dry-run"], tmp_path)
    assert "1 of 2 trials invalid" in line and "divisible" in line


def test_a_sweep_refuses_trials_too_large_for_the_machine(
    tmp_path: Path, base: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setattr(trial_runner, "machine_memory", lambda: 2**30)
    path = write(
        tmp_path / "wide.toml",
        'base = "spec.yaml"\nset = ["model.n_layers=8"]\n[axes]\n"model.d_model" = [4096]\n',
    )
    out = tmp_path / "out"
    line = refused(["sweep", str(path), "--out", str(out)], capsys, out)
    assert "t000-d_model=4096: model: about 1.61e+09 parameters" in line
    assert "more than this machine's memory (1.0 GiB)" in line


# -- (5) the study's storage ----------------------------------------------------------------------


def storages(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Unusable database URLs, and a word of the error each gives."""
    (tmp_path / "notes.txt").write_text("not a database\n" * 100)
    return {
        "garbage": ("garbage", "is not a database URL"),
        "unknown dialect": ("foo://", "cannot open the study's database"),
        "a missing directory": ("sqlite:////nonexistent/dir/x.db", "unable to open"),
        "a directory": (f"sqlite:///{tmp_path}", "unable to open"),
        "not a database": (f"sqlite:///{tmp_path / 'notes.txt'}", "cannot open"),
        "no driver": ("postgresql+nodriverllmkit://u:hunter2@localhost/db", "cannot open"),
        "a port too high": ("postgresql://u:hunter2@localhost:99999999/db", "is not a port"),
        "a port not a number": ("sqlite://:bad:port/x", "is not a database URL"),
        "empty": ("", "an empty database URL"),
        "blank": ("   ", "an empty database URL"),
        "in memory": ("sqlite://", "in-memory"),
        "in memory, named": ("sqlite:///:memory:", "in-memory"),
        "http": ("http://example.com/db", "cannot open"),
    }


STORAGE_CASES = [
    "garbage",
    "unknown dialect",
    "a missing directory",
    "a directory",
    "not a database",
    "no driver",
    "a port too high",
    "a port not a number",
    "empty",
    "blank",
    "in memory",
    "in memory, named",
    "http",
]


@pytest.mark.parametrize("case", STORAGE_CASES)
@pytest.mark.parametrize("given", ["--storage", "file"])
def test_an_unusable_storage_is_one_line_before_the_directory_is_made(
    case, given, tmp_path: Path, base: Path, capsys
) -> None:
    url, message = storages(tmp_path)[case]
    before = (tmp_path / "notes.txt").read_bytes()
    if given == "file":
        body = f"storage = {json.dumps(url)}\n"
        argv: list[str] = []
    else:
        body, argv = "", ["--storage", url]
    path = search_file(tmp_path, body + '[params]\n"optimizer.lr" = { uniform = [0.1, 1] }\n')
    out = tmp_path / "out"
    line = refused(["search", str(path), "--out", str(out), *argv], capsys, out)
    assert message in line
    assert "hunter2" not in line  # a password is never shown
    assert (tmp_path / "notes.txt").read_bytes() == before  # not written into


def test_an_unusable_storage_is_one_line_with_several_workers(tmp_path, base, capsys):
    """Checked once, before the other processes start (each would print its own line)."""
    path = search_file(tmp_path, '[params]\n"optimizer.lr" = { uniform = [0.1, 1] }\n')
    out = tmp_path / "out"
    argv = ["search", str(path), "--out", str(out), "--workers", "3", "--storage", "foo://"]
    assert "foo://" in refused(argv, capsys, out)


def test_an_unusable_storage_is_one_line_in_a_process(tmp_path: Path, base: Path) -> None:
    path = search_file(tmp_path, '[params]\n"optimizer.lr" = { uniform = [0.1, 1] }\n')
    for url in ("garbage", "foo://", "sqlite:////nonexistent/dir/x.db", ""):
        line = refused_subprocess(["search", str(path), "--out", "out", "--storage", url], tmp_path)
        assert "--storage" in line
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["inside --out", "beside it"])
def test_a_usable_storage_still_works_inside_or_outside_the_directory(
    where, tmp_path: Path, base: Path, monkeypatch
) -> None:
    """A SQLite file inside the search's directory is opened once the directory is made (as
    the default one is); elsewhere, before it is made. Either holds the study."""
    from tests.experiments.test_sweep_search_overrides import fake_trainer

    fake_trainer(monkeypatch)
    out = tmp_path / "out"
    db = out / "mine.db" if where == "inside --out" else tmp_path / "elsewhere.db"
    path = search_file(tmp_path, 'trials = 1\n[params]\n"optimizer.lr" = { uniform = [0.1, 1] }\n')
    result = run_search(path, out=out, storage=f"sqlite:///{db}", log=lambda _m: None)
    assert [r["state"] for r in result.rows] == ["COMPLETE"]
    assert db.is_file() and not (out / "study.db").exists()


def test_storage_problems_read_the_url_alone() -> None:
    assert storage_problem("sqlite:///runs/study.db") is None
    assert storage_problem("postgresql://user:pw@db.example:5432/optuna") is None
    assert "in-memory" in (storage_problem("sqlite:///file:x?mode=memory&uri=true") or "")


# -- seeds and the rest of a search file ----------------------------------------------------------

BAD_SEARCHES = {
    "seed < 0": ("seed = -1\n", "greater than or equal to 0"),
    "seed beyond NumPy": ("seed = 9223372036854775807\n", "less than or equal to 4294967295"),
    "unknown key": ("foo = 1\n", "unknown key"),
    "trials 0": ("trials = 0\n", "greater than or equal to 1"),
    "set a string": ('set = "x"\n', "valid list"),
    "set not an assignment": ('set = ["=x"]\n', "expected KEY=VALUE"),
    "storage a number": ("storage = 5\n", "valid string"),
    "metric unknown": ('metric = "train_loss"\n', "metric"),
    "nested": ("x = " + "[" * 5000 + "]" * 5000 + "\n", "nested more than"),
}
PARAMS = '[params]\n"optimizer.lr" = { uniform = [0.1, 1] }\n'
BAD_PARAMS = {
    "no params": ("", "params: Field required"),
    "params empty": ("[params]\n", "at least 1 item"),
    "a param a list": ('[params]\n"optimizer.lr" = [1, 2]\n', "exactly one of"),
    "a path not a path": ('[params]\n"a..b" = { uniform = [0, 1] }\n', "not a spec path"),
    "a path with =": ('[params]\n"a=b" = { uniform = [0, 1] }\n', "not a spec path"),
    "nan": ('[params]\n"optimizer.lr" = { uniform = [nan, 1] }\n', "finite"),
    "step too small": (
        '[params]\n"optimizer.lr" = { uniform = [0.0, 1.0], step = 5e-324 }\n',
        "too small for the range",
    ),
    "range overflows": (
        '[params]\n"optimizer.lr" = { uniform = [-1.7e308, 1.7e308] }\n',
        "wider than a float holds",
    ),
    "log from 0": ('[params]\n"optimizer.lr" = { log_uniform = [0, 1] }\n', "positive low end"),
}


@pytest.mark.parametrize("case", sorted(BAD_SEARCHES) + sorted(BAD_PARAMS))
def test_hostile_search_files_are_one_line(case, tmp_path: Path, base: Path, capsys) -> None:
    body, message = BAD_SEARCHES[case] if case in BAD_SEARCHES else BAD_PARAMS[case]
    text = body + PARAMS if case in BAD_SEARCHES else body
    path = search_file(tmp_path, text)
    out = tmp_path / "out"
    assert message in refused(["search", str(path), "--out", str(out)], capsys, out)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_seed_offset_beyond_numpy_is_one_line(workers, tmp_path: Path, base: Path, capsys):
    path = search_file(tmp_path, "seed = 4294966000\n" + PARAMS)
    out = tmp_path / "out"
    offset = "2000" if workers == 1 else "0"  # --workers adds 1000 per process
    argv = ["search", str(path), "--out", str(out), "--seed-offset", offset]
    line = refused([*argv, "--workers", str(workers)], capsys, out)
    assert "the largest seed Optuna's samplers take" in line


def test_a_yaml_search_with_integers_beyond_64_bits_is_one_line(tmp_path, base, capsys):
    path = write(
        tmp_path / "search.yaml",
        "name: s\nbase: spec.yaml\nparams:\n  train.max_steps: {int: [1, " + "9" * 400 + "]}\n",
    )
    out = tmp_path / "out"
    line = refused(["search", str(path), "--out", str(out)], capsys, out)
    assert "within [-2**63, 2**63)" in line
