"""Hostile or mistaken specs: each is one problem naming its path, found from the spec alone,
quickly and in bounded memory (docs/training.md, "What a spec may not do")."""

from __future__ import annotations

import textwrap
import time
from typing import Any

import pytest
import yaml

from llmkit import hookimpl
from llmkit.contracts import ComponentOptions, NoOptions
from llmkit.errors import LlmkitError, SpecError
from llmkit.optim import WarmupOptions, check_steps
from llmkit.spec import (
    MAX_PARAMETERS,
    estimate_parameters,
    fit_warmup,
    load_raw,
    load_spec,
    load_spec_dict,
    read_spec_file,
)
from tests.conftest import SPECS
from tests.helpers import registry_with, tiny_spec

SPEC = """
[model]
vocab_size = 64
d_model = 32
n_layers = 2
n_heads = 4
max_seq_len = 32

[tokenizer]
kind = "char"

[schedule]
name = "cosine"
warmup_steps = 10

[train]
max_steps = 100
"""


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text(SPEC)
    return path


def one_problem(path, *sets: str, registry: Any = None) -> str:
    """The single problem loading ``path`` with ``sets`` reports."""
    with pytest.raises(SpecError) as err:
        load_spec(path, list(sets), registry=registry)
    assert len(err.value.problems) == 1, err.value.problems
    return err.value.problems[0]


@pytest.mark.parametrize(
    ("assignment", "expected"),
    [
        ("model.overrides=[{layers=1.5}]", "model.overrides[0].layers: expected a list of"),
        ("model.overrides=[{layers=true}]", "model.overrides[0].layers: expected a list of"),
        ("model.overrides=[{layers={a=1}}]", "model.overrides[0].layers: expected a list of"),
        ("model.overrides=[{layers=[1.5]}]", "model.overrides[0].layers: expected a list of"),
        ("model.n_layers=1000000000", "model.n_layers: Input should be less than or equal to 1024"),
        (f"model.d_model={2**70}", "model.d_model: Input should be less than or equal to 65536"),
        (f"model.max_seq_len={2**40}", "model.max_seq_len: Input should be less than or equal"),
        (f"model.vocab_size={2**40}", "model.vocab_size: Input should be less than or equal"),
        (f"tokenizer.vocab_size={2**40}", "tokenizer.vocab_size: Input should be less than"),
        ('train.device="meta"', "train.device: 'meta' is not a device training can use; use "),
        ('train.device="xla"', "train.device: 'xla' is not a device training can use"),
        ('train.device="cuda:x"', "train.device: 'cuda:x' is not a device"),
        ("optimizer.lr=inf", "optimizer.lr: Input should be a finite number"),
        ("optimizer.betas=[nan, 0.9]", "optimizer.betas[0]: Input should be a finite number"),
        ("model.init_std=inf", "model.init_std: Input should be a finite number"),
        ("model.init_std=nan", "model.init_std: Input should be a finite number"),
        ('model.position={name="rope", theta=inf}', "model.position.theta: Input should be a"),
        ("schedule.min_lr_ratio=nan", "schedule.min_lr_ratio: Input should be a finite number"),
        ("train.max_time=inf", "train.max_time: Input should be a finite number"),
        ("train.max_steps=5", "schedule.warmup_steps: 10 exceeds train.max_steps (5)"),
        ('model.adapter={name="lora"}', "model.adapter: adapters need train.init_from"),
        (
            'model.ffn={name="mlp", hidden=1099511627776}',
            f"above the limit of {MAX_PARAMETERS:.0e}".replace("e+", "e"),
        ),
    ],
)
def test_a_hostile_value_is_one_problem_with_its_path(spec_file, assignment, expected):
    start = time.monotonic()
    assert expected in one_problem(spec_file, assignment)
    assert time.monotonic() - start < 5  # n_layers = 1e9 took 35 s, then MemoryError


def test_the_device_forms_training_can_use_are_accepted(spec_file):
    for device in ("auto", "cpu", "cuda", "cuda:1", "mps"):
        assert load_spec(spec_file, [f'train.device="{device}"']).spec.train.device == device


def test_a_schedule_that_cannot_be_built_for_the_run_is_refused(spec_file):
    problem = one_problem(spec_file, 'schedule={name="wsd", warmup_steps=9}', "train.max_steps=10")
    assert problem.startswith("schedule: schedule 'wsd': warmup_steps (9) + decay steps")


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (
            ['tokenizer={kind="bpe", vocab_size=100}'],
            "tokenizer.vocab_size: 100 is too small for byte-level BPE: it needs at least 257 "
            "(256 bytes + 1 special tokens)",
        ),
        (['tokenizer={kind="bpe"}'], "model.vocab_size: 64 is too small for byte-level BPE"),
        (
            ['tokenizer={kind="bpe", special_tokens=["<a>", "<b>"]}', "model.vocab_size=257"],
            "model.vocab_size: 257 is too small for byte-level BPE: it needs at least 258",
        ),
    ],
)
def test_a_bpe_vocabulary_below_its_bytes_is_refused_before_any_data(spec_file, sets, expected):
    assert one_problem(spec_file, *sets).startswith(expected)


def test_a_bpe_vocabulary_is_not_checked_when_none_is_trained(spec_file):
    load_spec(spec_file, ['tokenizer={kind="bpe", path="tok.json"}'])
    load_spec(spec_file, ['tokenizer={kind="bpe"}', 'train.init_from="somewhere"'])
    load_spec(spec_file, ['tokenizer={kind="bpe"}', "model.vocab_size=257"])


class PatchOptions(ComponentOptions):
    needs_base_weights = True


class PatchPlugin:
    @hookimpl
    def register_kinds(self, register):
        register("patch", "Weight patch", section="model.patch")

    @hookimpl
    def register_components(self, register):
        register("patch", "delta", "llmkit.components.ffn.mlp:MLP", options=PatchOptions)


def test_components_that_adapt_base_weights_say_so_in_their_options(spec_file):
    """The adapter check asks the options (``needs_base_weights``), not the kind's name."""
    reg = registry_with(PatchPlugin())
    problem = one_problem(spec_file, 'model.patch={name="delta"}', registry=reg)
    assert problem == "model.patch: adapters need train.init_from, the base weights they adapt"
    load_spec(spec_file, ['model.patch={name="delta"}', 'train.init_from="base"'], registry=reg)


def test_training_checks_spare_specs_that_only_describe_a_model():
    """``load_spec_dict`` (a model built in code) keeps accepting a BPE vocabulary of 64, an
    adapter without base weights and a warmup longer than the default run."""
    spec = tiny_spec(adapter={"name": "lora"})
    spec["schedule"] = {"name": "cosine", "warmup_steps": 5000}
    assert load_spec_dict(spec).model.vocab_size == 64


def test_every_example_spec_is_a_valid_training_recipe():
    for path in sorted(SPECS.glob("*.toml")) + sorted(SPECS.glob("*.yaml")):
        load_spec(path)


def test_the_parameter_estimate_is_a_close_lower_bound():
    rs = load_spec(SPECS / "gpt2-small.toml")
    estimate = estimate_parameters(rs.spec, rs.layers)
    assert 0.99 * 124_439_808 < estimate <= 124_439_808  # llmkit info's exact count


class CountedOptions(ComponentOptions):
    width: int = 3

    def parameter_count(self, d_model: int, bias: bool) -> int:
        return self.width * d_model


class FFNPlugin:
    @hookimpl
    def register_components(self, register):
        register("ffn", "counted", "llmkit.components.ffn.mlp:MLP", options=CountedOptions)
        register("ffn", "silent", "llmkit.components.ffn.mlp:MLP", options=NoOptions)


def test_an_ffn_is_estimated_by_its_options_count_else_generically():
    """The estimate asks the ffn's options (``parameter_count``); one whose options do not
    say (None, the default) counts as a 4·d_model MLP without biases, 8·d²."""
    from llmkit.spec.limits import ffn_parameters, generic_ffn_parameters

    reg = registry_with(FFNPlugin())
    base = load_spec_dict(tiny_spec(ffn={"name": "mlp", "hidden": 1}), registry=reg)
    floor = estimate_parameters(base.spec, base.layers) - 2 * ffn_parameters(
        base.layers[0].ffn.options, 32, True
    )
    counted = load_spec_dict(tiny_spec(ffn={"name": "counted", "width": 5}), registry=reg)
    assert estimate_parameters(counted.spec, counted.layers) == floor + 2 * 5 * 32
    silent = load_spec_dict(tiny_spec(ffn={"name": "silent"}), registry=reg)
    assert generic_ffn_parameters(32) == 8 * 32 * 32
    assert estimate_parameters(silent.spec, silent.layers) == floor + 2 * 8 * 32 * 32


# -- reading files ---------------------------------------------------------------------------


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_yaml_alias_bomb_is_refused_quickly(tmp_path):
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    lines.append("model: {d_model: 32, n_layers: 2, n_heads: 4, x: *i}")
    path = write(tmp_path, "bomb.yaml", "\n".join(lines))
    assert path.stat().st_size < 1024
    start = time.monotonic()
    with pytest.raises(LlmkitError, match=r"invalid YAML: aliases expand to more than 100,000"):
        read_spec_file(path)
    assert time.monotonic() - start < 2


def test_yaml_anchors_within_the_budget_and_merge_keys_still_work(tmp_path):
    shared = {"name": "sdpa"}
    dumped = yaml.safe_dump({"model": {"attention": shared, "x": shared}})
    assert "&id001" in dumped  # how a run's spec.yaml writes a shared table
    path = write(tmp_path, "run.yaml", dumped)
    assert read_spec_file(path)["model"]["x"] == {"name": "sdpa"}
    path = write(
        tmp_path,
        "merge.yaml",
        """
        base: &b {d_model: 32, n_layers: 2}
        model:
          <<: *b
          d_model: 64
        """,
    )
    assert read_spec_file(path)["model"] == {"d_model": 64, "n_layers": 2}


def test_a_recursive_yaml_alias_is_refused(tmp_path):
    path = write(tmp_path, "rec.yaml", "a: &a [1, *a]\n")
    with pytest.raises(LlmkitError, match="invalid YAML: recursive alias"):
        read_spec_file(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "model:\n  d_model: 32\n  n_layers: 2\n  d_model: 64\n",
            "invalid YAML: duplicate key 'd_model' at line 4 (first at line 2)",
        ),
        (
            "model: {n_heads: 4, n_heads: 2}\n",
            "invalid YAML: duplicate key 'n_heads' at line 1 (first at line 1)",
        ),
        (
            "model: {}\nmodel: {}\n",
            "invalid YAML: duplicate key 'model' at line 2 (first at line 1)",
        ),
    ],
)
def test_yaml_duplicate_keys_are_refused_with_the_key_and_line(tmp_path, text, expected):
    path = write(tmp_path, "dup.yaml", text)
    with pytest.raises(LlmkitError) as err:
        read_spec_file(path)
    assert str(err.value) == f"{path}: {expected}"


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("deep.toml", "a = " + "[" * 3000 + "]" * 3000, "invalid TOML: nested more than"),
        ("deep2.toml", "a = " + "{b=" * 100 + "1" + "}" * 100, "nested more than 32 levels"),
        ("deep.yaml", "a: " + "[" * 3000 + "]" * 3000, "invalid YAML: nested more than"),
    ],
)
def test_deep_nesting_is_refused_in_the_files_own_format(tmp_path, name, text, expected):
    path = write(tmp_path, name, text)
    with pytest.raises(LlmkitError, match=expected) as err:
        read_spec_file(path)
    assert "\n" not in str(err.value)


# -- fitting the warmup to --max-steps -------------------------------------------------------


def raw(spec_file, *sets: str) -> dict[str, Any]:
    from llmkit.spec import apply_override

    data = load_raw(spec_file)
    for s in sets:
        apply_override(data, s)
    return data


def test_a_shorter_max_steps_scales_the_warmup(spec_file):
    assignment, note = fit_warmup(raw(spec_file), 5)
    assert assignment == "schedule.warmup_steps=1"  # 10 of 100 steps -> 0.5, at least 1
    assert note == (
        "--max-steps 5 is shorter than schedule.warmup_steps (10): warmup scaled to 1 steps "
        "(the spec warms up for 10 of 100 steps)"
    )
    assert fit_warmup(raw(spec_file), 8)[0] == "schedule.warmup_steps=1"
    assert fit_warmup(raw(spec_file, "schedule.warmup_steps=90"), 9)[0] == (
        "schedule.warmup_steps=8"
    )
    load_spec(spec_file, ["schedule.warmup_steps=8", "train.max_steps=9"])


def test_the_warmup_is_left_alone_when_it_fits_or_the_spec_contradicts_itself(spec_file):
    assert fit_warmup(raw(spec_file), 10) is None
    assert fit_warmup(raw(spec_file, "schedule.warmup_steps=0"), 1) is None
    assert fit_warmup(raw(spec_file, "train.max_steps=5"), 3) is None  # its own error
    assert fit_warmup(raw(spec_file, 'schedule={name="constant"}'), 1) is None


class RampOptions(WarmupOptions):
    """A plugin schedule whose warmup is the option ``ramp``, not ``warmup_steps``."""

    warmup_steps: int = 0
    ramp: int = 0
    warmup_option = "ramp"

    def warmup(self, max_steps: int) -> int:
        return self.ramp


def build_ramp(options: RampOptions, *, total_steps: int, base_lr: float = 1.0):
    check_steps(options.ramp, total_steps, "ramp")
    return lambda step: base_lr * min(1.0, (step + 1) / max(options.ramp, 1))


class RampPlugin:
    @hookimpl
    def register_components(self, register):
        register("schedule", "ramp", build_ramp, options=RampOptions)


def test_a_schedule_says_which_option_sets_its_warmup(spec_file):
    reg = registry_with(RampPlugin())
    data = raw(spec_file, 'schedule={name="ramp", ramp=20}')
    assignment, note = fit_warmup(data, 5, registry=reg)
    assert assignment == "schedule.ramp=1"
    assert note.startswith("--max-steps 5 is shorter than schedule.ramp (20)")
    problem = one_problem(spec_file, 'schedule={name="ramp", ramp=200}', registry=reg)
    assert problem == "schedule.ramp: 200 exceeds train.max_steps (100)"
    assert RampOptions(ramp=3).with_warmup(7) == RampOptions(ramp=7)


def test_a_wsd_warmup_is_reduced_until_the_decay_fits(spec_file):
    sets = ['schedule={name="wsd", warmup_steps=50, decay_fraction=0.5}']
    assignment, _ = fit_warmup(raw(spec_file, *sets), 3)  # 50 of 100 -> 2; the decay needs 2
    assert assignment == "schedule.warmup_steps=1"
    load_spec(spec_file, [*sets, assignment, "train.max_steps=3"])
