"""One distribution vocabulary for random sweeps and searches
(``llmkit.experiments.distributions``): the same table read by either file is the same
object, draws for a sweep and suggests to Optuna over the same values, and is refused with
the same one-line problem."""

from __future__ import annotations

import random

import pytest
import yaml

from llmkit.errors import SpecError
from llmkit.experiments.distributions import Choice, Int, LogUniform, Uniform
from llmkit.experiments.search import SearchSpec, read_search
from llmkit.experiments.sweep_axes import SweepFile, read_sweep

TABLES = {
    "lr": ({"log_uniform": [1e-4, 1e-2]}, LogUniform),
    "clip": ({"uniform": [0.5, 2.0]}, Uniform),
    "dropout": ({"uniform": [0.0, 0.3], "step": 0.1}, Uniform),
    "warmup": ({"int": [0, 60], "step": 10}, Int),
    "layers": ({"int": [1, 8]}, Int),
    "width": ({"int": [16, 512], "log": True}, Int),
    "norm": ({"choice": [{"name": "rmsnorm"}, {"name": "layernorm"}]}, Choice),
}


def both(tables: dict) -> tuple[dict, dict]:
    """The tables as a random sweep's axes and as a search's parameters."""
    sweep = SweepFile.model_validate({"base": "x", "random": {"samples": 1, "axes": tables}}).random
    search = SearchSpec.model_validate({"name": "s", "base": "x", "params": tables})
    assert sweep is not None
    return sweep.axes, search.params


def test_one_distribution_drives_a_sweep_draw_and_an_optuna_suggest():
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    axes, params = both({k: t for k, (t, _) in TABLES.items()})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    rng = random.Random(0)
    for name, (_, kind) in TABLES.items():
        dist = axes[name]
        assert type(dist) is kind and params[name] == dist  # one model, whichever file
        grid = dist.grid()
        lo, hi = dist.ends()
        for _ in range(40):
            drawn, suggested = dist.draw(rng), dist.suggest(study.ask(), name)
            for value in (drawn, suggested):
                if grid is not None:
                    assert value in grid, (name, value)
                else:
                    assert lo <= value <= hi, (name, value)
            assert type(drawn) is type(suggested) or kind is Choice
    assert axes["warmup"].grid() == [0, 10, 20, 30, 40, 50, 60]
    assert axes["dropout"].grid() == [0.0, 0.1, 0.2, 0.3]  # not 0.30000000000000004
    assert axes["width"].log and axes["lr"].log and not axes["layers"].log
    trial = study.ask()
    axes["width"].suggest(trial, "w")
    axes["warmup"].suggest(trial, "u")
    assert trial.distributions["w"] == optuna.distributions.IntDistribution(16, 512, log=True)
    assert trial.distributions["u"] == optuna.distributions.IntDistribution(0, 60, step=10)


def test_a_step_that_does_not_divide_the_range_ends_on_the_last_step():
    dist = Int.model_validate({"int": [0, 25], "step": 10})
    assert dist.ends() == [0, 20] and dist.grid() == [0, 10, 20]
    rng = random.Random(0)
    assert {dist.draw(rng) for _ in range(200)} == {0, 10, 20}
    assert Uniform.model_validate({"uniform": [0, 1], "step": 0.4}).ends() == [0, 0.8]


def test_draws_are_reproducible_and_those_of_the_old_vocabulary():
    """``{int = [1, 8]}`` draws what ``{uniform = [1, 8], integer = true}`` drew, and
    ``{int = [1, 8], log = true}`` what ``{log_uniform = [1, 8], integer = true}`` drew."""
    import math

    rng, old = random.Random(3), random.Random(3)
    flat = Int.model_validate({"int": [1, 8]})
    log = Int.model_validate({"int": [1, 8], "log": True})
    for _ in range(50):
        assert flat.draw(rng) == old.randint(1, 8)
        value = math.exp(old.uniform(math.log(0.5), math.log(8.5)))
        assert log.draw(rng) == min(max(round(value), 1), 8)


BAD = [
    ({"log_uniform": [1e-2, 1e-4]}, "the range [0.01, 0.0001] must go from low to high"),
    ({"log_uniform": [0, 1]}, "log_uniform needs a positive low end"),
    ({"uniform": [0, 1], "choice": [1]}, "give exactly one of log_uniform, uniform, int, choice"),
    ({"step": 2}, "give exactly one of log_uniform, uniform, int, choice"),
    ({"uniform": [0, 1], "integer": True}, "integers are drawn by {int = [lo, hi]}"),
    ({"int": [0, 8], "log": True}, "int with log = true needs a low end ≥ 1"),
    ({"int": [1, 8], "log": True, "step": 2}, "int takes log = true or a step, not both"),
    ({"int": [1, 8], "step": 1.5}, "step: Input should be a valid integer"),
    ({"uniform": [0, 1], "step": 2}, "step 2.0 is wider than the range [0.0, 1.0]"),
    ({"choice": []}, "choice: List should have at least 1 item"),
    ({"choice": [1, None]}, "null cannot be set through --set"),
    ({"log_uniform": [1e-4, 1e-2], "step": 0.1}, "step: unknown key (allowed: log_uniform)"),
]


@pytest.mark.parametrize(("table", "message"), BAD)
def test_a_bad_distribution_is_one_line_and_the_same_in_both_files(tmp_path, table, message):
    (tmp_path / "spec.yaml").write_text("{}")
    problems = []
    for name, text in (
        ("sweep.yaml", {"base": "spec.yaml", "random": {"samples": 1, "axes": {"x.y": table}}}),
        ("search.yaml", {"name": "s", "base": "spec.yaml", "params": {"x.y": table}}),
    ):
        path = tmp_path / name
        path.write_text(yaml.safe_dump(text))
        with pytest.raises(SpecError) as info:
            (read_sweep if name == "sweep.yaml" else read_search)(path)
        assert len(info.value.problems) == 1, info.value.problems
        problem = info.value.problems[0]
        assert message in problem and "\n" not in problem
        problems.append(problem.partition(": ")[2])  # without the path, which differs
    assert problems[0] == problems[1]
