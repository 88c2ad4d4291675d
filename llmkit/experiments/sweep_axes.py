"""The sweep file: its pydantic model (and JSON Schema), reading it, and expanding its axes
into trials with stable ids and ``--set`` overrides.

A grid sweep is the cartesian product of its ``axes`` and ``zip`` groups (the first axis
varies slowest), a random sweep ``random.samples`` draws of its distributions; both are
repeated once per seed (seeds vary fastest). See docs/experiments.md, "Sweeps".
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from llmkit.errors import LlmkitError, SpecError, validation_problems
from llmkit.experiments.distributions import (
    DISTRIBUTIONS,
    Distribution,
    ValueList,
    table_keys,
)

#: A spec path an axis sets: dotted names (list elements by index), as ``--set`` takes them.
PATH_PATTERN = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
#: Characters a trial id keeps; every run of others becomes ``_``.
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")
MAX_ID_LENGTH = 120
#: Generated values of log/linear ranges are rounded to this many significant
#: digits, so ``{log = [1e-4, 1e-2], num = 3}`` gives exactly 0.0001, 0.001 and 0.01.
RANGE_DIGITS = 12
#: The most trials a sweep may have: the product of its axes' lengths (each zip group counts
#: once), or its random samples, times its seeds, counted before anything is expanded. Every
#: trial's spec is resolved and checked before any trial runs (about 5 ms and 25 kB each:
#: 10,000 trials take about a minute and 250 MB to validate), and each trial is a training
#: run of its own.
MAX_TRIALS = 10_000
#: The most values one range axis (``num``) may have, and the largest seed count.
MAX_AXIS_VALUES = 10_000
#: The most text the trials' ``--set`` overrides may hold together (each trial's overrides
#: are written, and resolved, once per trial): a 1 MB value on an axis of a 10,000-trial
#: sweep would be 10 GB.
MAX_OVERRIDE_BYTES = 64 * 2**20
#: Which results column each ``metric`` names.
METRIC_COLUMNS = {
    "val_ce": "final_val_ce",
    "best_val_ce": "best_val_ce",
    "val_loss": "final_val_loss",
    "best_val_loss": "best_val_loss",
    "train_loss": "final_train_loss",
}


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


def check_assignments(sets: list[str]) -> list[str]:
    """``sets`` when each is ``KEY=VALUE`` with a spec path for a key (a sweep's or a search's
    ``set``); a ValueError naming the first that is not."""
    for s in sets:
        key, sep, _ = s.partition("=")
        if not sep or not PATH_PATTERN.fullmatch(key.strip()):
            raise ValueError(f"{s!r}: expected KEY=VALUE, e.g. train.max_steps=200")
    return sets


def spaced(lo: float, hi: float, num: int, *, log: bool, integer: bool) -> list[Any]:
    """``num`` values from ``lo`` to ``hi`` (both included), evenly spaced in log space or
    linearly, rounded to :data:`RANGE_DIGITS` significant digits or to integers (repeats
    dropped)."""
    if num == 1:
        points = [lo]
    elif log:
        a, b = math.log10(lo), math.log10(hi)
        points = [lo, *(10 ** (a + i * (b - a) / (num - 1)) for i in range(1, num - 1)), hi]
    else:
        points = [lo, *(lo + i * (hi - lo) / (num - 1) for i in range(1, num - 1)), hi]
    if not integer:
        return [float(f"{p:.{RANGE_DIGITS}g}") for p in points]
    out: list[Any] = []
    for p in points:
        if round(p) not in out:
            out.append(round(p))
    return out


class LogRange(_Table):
    """``{log = [lo, hi], num = N}``: N log-spaced values from lo to hi (both > 0)."""

    log: tuple[float, float] = Field(description="The first and last value, both > 0.")
    num: int = Field(ge=1, le=MAX_AXIS_VALUES, description="How many values, both ends included.")
    integer: bool = Field(False, description="Round each value to an integer (repeats dropped).")

    @field_validator("log")
    @classmethod
    def _positive(cls, ends: tuple[float, float]) -> tuple[float, float]:
        if min(ends) <= 0:
            raise ValueError("a log-spaced range needs two values > 0")
        return ends

    def values(self) -> list[Any]:
        return spaced(*self.log, self.num, log=True, integer=self.integer)


class LinearRange(_Table):
    """``{linear = [lo, hi], num = N}``: N evenly spaced values from lo to hi."""

    linear: tuple[float, float] = Field(description="The first and last value.")
    num: int = Field(ge=1, le=MAX_AXIS_VALUES, description="How many values, both ends included.")
    integer: bool = Field(False, description="Round each value to an integer (repeats dropped).")

    @field_validator("linear")
    @classmethod
    def _finite_width(cls, ends: tuple[float, float]) -> tuple[float, float]:
        if not math.isfinite(ends[1] - ends[0]):
            raise ValueError(f"the range {list(ends)} is wider than a float holds")
        return ends

    def values(self) -> list[Any]:
        return spaced(*self.linear, self.num, log=False, integer=self.integer)


def _kind(value: Any, kinds: tuple[str, ...]) -> str | None:
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return next((k for k in kinds if k in value), None)
    if isinstance(value, BaseModel):
        return next((k for k in kinds if k in type(value).model_fields), None)
    return None


#: One grid axis: a list of values, or a log- or linearly spaced range.
Axis = Annotated[
    Union[  # noqa: UP007
        Annotated[ValueList, Tag("list")],
        Annotated[LogRange, Tag("log")],
        Annotated[LinearRange, Tag("linear")],
    ],
    Discriminator(
        lambda v: _kind(v, ("log", "linear")),
        custom_error_type="axis",
        custom_error_message="an axis is a list of values, {log = [lo, hi], num = N} or "
        "{linear = [lo, hi], num = N} (a single value belongs in `set`)",
    ),
]


class RandomSearch(_Table):
    """``[random]``: ``samples`` draws of every axis in ``axes``, reproducible from ``seed``."""

    samples: int = Field(ge=1, le=MAX_TRIALS, description="How many configurations to draw.")
    seed: int = Field(0, ge=0, description="Seed of the draws (not the trials' train.seed).")
    axes: dict[str, Distribution] = Field(
        min_length=1, description="Spec path -> distribution, e.g. optimizer.lr."
    )


#: ``seeds``: a list of seeds, or how many (read as 0..n-1 before validation).
_SEEDS_SCHEMA = {
    "anyOf": [
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "integer", "minimum": 1, "maximum": MAX_AXIS_VALUES},
        {"type": "null"},
    ]
}


class SweepFile(_Table):
    """A sweep file: a base spec, fixed overrides, and the axes trials vary."""

    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        max_length=100,
        description="The sweep's name (its default directory runs/sweeps/<name>); default: the "
        "sweep file's name.",
    )
    description: str | None = None
    base: str = Field(
        min_length=1,
        description="The spec every trial starts from: a file relative to the sweep file, "
        "or a preset name.",
    )
    overrides: list[str] = Field(
        default_factory=list,
        alias="set",
        description="--set overrides for every trial, applied before the axes.",
    )
    seeds: Annotated[list[int] | None, WithJsonSchema(_SEEDS_SCHEMA)] = Field(
        None,
        min_length=1,
        description="Repeat every configuration once per seed (train.seed); an integer n "
        "means seeds 0..n-1.",
    )
    metric: Literal["val_ce", "best_val_ce", "val_loss", "best_val_loss", "train_loss"] = Field(
        "val_ce",
        description="What ranks trials and the plots show: the final or best validation "
        "cross-entropy (comparable across objectives), the final or best validation "
        "objective (val_loss: the same for the cross-entropy, the mixed loss for "
        "distillation), or the final training loss.",
    )
    axes: dict[str, Axis] = Field(
        default_factory=dict,
        description="Spec path -> values; the grid is the product of every axis and zip group.",
    )
    zipped: list[dict[str, Axis]] = Field(
        default_factory=list,
        alias="zip",
        description="Groups of axes that vary together (equal lengths): one grid axis each.",
    )
    random: RandomSearch | None = Field(
        None, description="Random search instead of a grid (no `axes` or `zip` beside it)."
    )
    branch_budgets: bool = Field(
        False,
        description="Trials that differ only in train.max_steps (a WSD schedule) share one "
        "run: the longest trains and keeps a checkpoint where each shorter budget's decay "
        "starts; each shorter trial is branched from there and trains only its decay "
        "(exactly as a run of its own; see docs/experiments.md).",
    )

    @field_validator("seeds", mode="before")
    @classmethod
    def _seed_count(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            if not 1 <= value <= MAX_AXIS_VALUES:
                raise ValueError(f"a seed count must be between 1 and {MAX_AXIS_VALUES}")
            return list(range(value))
        return value

    @field_validator("seeds")
    @classmethod
    def _seed_values(cls, seeds: list[int] | None) -> list[int] | None:
        if seeds is not None:
            if any(not 0 <= s < 2**63 for s in seeds):
                raise ValueError("seeds must be in [0, 2**63)")
            seen: set[int] = set()
            for s in seeds:
                if s in seen:  # named alone: the list may be long
                    raise ValueError(f"seeds must be distinct; {s} appears twice")
                seen.add(s)
        return seeds

    @field_validator("overrides")
    @classmethod
    def _assignments(cls, sets: list[str]) -> list[str]:
        return check_assignments(sets)

    @model_validator(mode="after")
    def _axes(self) -> SweepFile:
        if self.random is not None and (self.axes or self.zipped):
            raise ValueError("random: a random search replaces the grid; drop `axes` and `zip`")
        paths: list[str] = []
        for group in self.zipped:
            if not group:
                raise ValueError("zip: a group needs at least one axis")
            lengths = {p: len(axis_values(a)) for p, a in group.items()}
            if len(set(lengths.values())) > 1:
                sizes = ", ".join(f"{p} has {n}" for p, n in lengths.items())
                raise ValueError(f"zip: the axes of a group need as many values each ({sizes})")
        for group in (self.axes, *self.zipped, self.random.axes if self.random else {}):
            paths += list(group)
            bad = [p for p in group if not PATH_PATTERN.fullmatch(p)]
            if bad:
                raise ValueError(f"{bad[0]!r} is not a spec path such as optimizer.lr")
        twice = sorted({p for p in paths if paths.count(p) > 1})
        if twice:
            raise ValueError(f"an axis appears twice: {', '.join(twice)}")
        if self.seeds is not None and "train.seed" in paths:
            raise ValueError("`seeds` sets train.seed: it cannot also be an axis")
        too_many = trial_count_problem(self) or override_bytes_problem(self)
        if too_many:
            raise ValueError(too_many)
        return self


def axis_values(axis: Any) -> list[Any]:
    """The values of a grid axis (a list, or a range)."""
    return list(axis) if isinstance(axis, list) else axis.values()


def axis_length(axis: Any) -> int:
    """How many values a grid axis has, without making a range's values when it has one."""
    if isinstance(axis, list):
        return len(axis)
    return len(axis.values()) if axis.integer else axis.num  # an integer range drops repeats


def dimensions(sweep: SweepFile) -> list[tuple[str, int]]:
    """What the sweep's trial count multiplies: each axis, zip group, the random samples and
    the seeds, as (what, how many)."""
    dims: list[tuple[str, int]] = []
    if sweep.random is not None:
        dims.append(("samples", sweep.random.samples))
    for path, axis in sweep.axes.items():
        dims.append((path, axis_length(axis)))
    for i, group in enumerate(sweep.zipped):
        dims.append((f"zip[{i}]", axis_length(next(iter(group.values())))))
    if sweep.seeds is not None:
        dims.append(("seeds", len(sweep.seeds)))
    return dims


def trial_count(sweep: SweepFile) -> int:
    """How many trials the sweep has, counted from its axes' lengths (nothing expanded)."""
    return math.prod(n for _, n in dimensions(sweep))


def trial_count_problem(sweep: SweepFile) -> str | None:
    """The one-line refusal of a sweep with more than :data:`MAX_TRIALS` trials, or None."""
    dims = dimensions(sweep)
    n = math.prod(k for _, k in dims)
    if n <= MAX_TRIALS:
        return None
    shown = " × ".join(f"{k:,} {what}" for what, k in dims if k > 1)
    return (
        f"the sweep has {n:,} trials ({shown}), more than the limit of {MAX_TRIALS:,}; "
        "use fewer or shorter axes, samples or seeds"
    )


def override_bytes(sweep: SweepFile, sets: list[str] | None = None) -> int:
    """The most text one trial's overrides hold (the file's ``set``, ``sets``, the longest
    value of each axis, the seed), times the number of trials: what expanding the sweep
    writes, counted before it does."""
    per_trial = sum(len(a) for a in [*sweep.overrides, *(sets or [])]) + 32
    if sweep.random is not None:
        axes: dict[str, Any] = dict(sweep.random.axes)
    else:
        axes = {**sweep.axes, **{p: a for g in sweep.zipped for p, a in g.items()}}
    for path, axis in axes.items():
        values = axis if isinstance(axis, list) else getattr(axis, "choice", None)
        longest = max((len(toml_literal(v)) for v in values), default=0) if values else 32
        per_trial += len(path) + 1 + longest
    return per_trial * trial_count(sweep)


def override_bytes_problem(sweep: SweepFile, sets: list[str] | None = None) -> str | None:
    """The one-line refusal of a sweep whose trials' overrides would hold more than
    :data:`MAX_OVERRIDE_BYTES` together, or None."""
    n = override_bytes(sweep, sets)
    if n <= MAX_OVERRIDE_BYTES:
        return None
    return (
        f"the sweep's {trial_count(sweep):,} trials would hold about {n / 2**20:,.0f} MiB of "
        f"--set overrides together, more than the limit of {MAX_OVERRIDE_BYTES // 2**20} MiB; "
        "use shorter values (or fewer trials)"
    )


def override_paths(assignments: list[str]) -> list[str]:
    """The spec paths of ``KEY=VALUE`` overrides; :class:`LlmkitError` for one that is not."""
    paths = []
    for a in assignments:
        key, sep, _ = a.partition("=")
        if not sep or not PATH_PATTERN.fullmatch(key.strip()):
            raise LlmkitError(f"--set {a!r}: expected KEY=VALUE, e.g. train.max_steps=200")
        paths.append(key.strip())
    return paths


def check_overrides(
    sets: list[str], max_steps: int | None, varied: list[str], what: str = "sweep"
) -> None:
    """Refuse, in one line, a command-line ``--set`` of a path the sweep or search varies
    (``varied``: its axes, ``train.seed`` under ``seeds``, or its parameters) or of a path
    inside one, and ``--max-steps`` when it varies ``train.max_steps``: every trial would
    train one value, or the varied value would replace the override."""
    for a, path in zip(sets, override_paths(sets), strict=True):
        hit = next((v for v in varied if path == v or path.startswith(v + ".")), None)
        if hit is not None:
            raise LlmkitError(
                f"--set {a}: this {what} varies {hit}; its values come from the {what} file"
            )
    if max_steps is not None and "train.max_steps" in varied:
        raise LlmkitError(
            f"--max-steps {max_steps}: this {what} varies train.max_steps; its values come "
            f"from the {what} file"
        )


def sweep_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a sweep file."""
    schema = SweepFile.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "llmkit sweep"
    return schema


def read_sweep(path: str | Path) -> SweepFile:
    """Read and validate a sweep file (TOML or YAML, read as spec files are); a
    :class:`SpecError` lists every problem, each with its path in the file."""
    from llmkit.spec import read_spec_file

    p = Path(path)
    if not p.is_file():
        raise LlmkitError(f"sweep file not found: {p}")
    data = read_spec_file(p)
    try:
        return SweepFile.model_validate(data)
    except ValidationError as exc:
        problems = validation_problems(
            exc, top=None, quote_dotted=True, shown=_shown, allowed=_allowed
        )
        raise SpecError(problems, str(p)) from None


#: The tables an axis may be, by the tag pydantic puts in an error's location.
_TAGGED: dict[str, type[BaseModel] | None] = {
    "list": None,
    "log": LogRange,
    "linear": LinearRange,
    **DISTRIBUTIONS,
}


def _is_tag(loc: tuple[Any, ...], i: int) -> bool:
    """Whether ``loc[i]`` is the tag pydantic adds to an axis table's errors (not in the file)."""
    axis_key = i >= 2 and (loc[i - 2] == "axes" or (i >= 3 and loc[i - 3] == "zip"))
    return axis_key and isinstance(loc[i], str) and loc[i] in _TAGGED


def _shown(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(part for i, part in enumerate(loc) if not _is_tag(loc, i))


def _allowed(loc: tuple[Any, ...]) -> list[str]:
    """The keys of the table an unknown key at ``loc`` sits in."""
    table: type[BaseModel] = SweepFile
    for i, part in enumerate(loc):
        if _is_tag(loc, i):
            table = _TAGGED[part] or table
        elif part == "random" and i == 0:
            table = RandomSearch
    return table_keys(table)


# -- trials -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    """One configuration of a sweep: its id, the axis values it sets (spec path -> value),
    its seed (None when the sweep names no seeds) and every ``--set`` override it trains
    with (the sweep's ``set``, then the axes, then ``train.seed``)."""

    index: int
    id: str
    values: dict[str, Any]
    seed: int | None
    overrides: list[str] = field(default_factory=list)


def toml_literal(value: Any) -> str:
    """``value`` as the ``--set`` syntax reads it back (TOML): ``0.001``, ``"sdpa"``,
    ``[1, 2]``, ``{name = "rope"}``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{toml_literal(str(k))} = {toml_literal(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    raise ValueError(f"{value!r} cannot be written as a --set value")


def value_label(value: Any) -> str:
    """A short label of an axis value for trial ids: ``0.001``, ``4``, ``rope``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "+".join(value_label(v) for v in value)
    if isinstance(value, dict):
        return str(value.get("name")) if "name" in value else json.dumps(value, sort_keys=True)
    return str(value)


def short_names(paths: list[str]) -> dict[str, str]:
    """Each path's last name (``optimizer.lr`` -> ``lr``), or the whole path where two
    axes share a last name."""
    last = [p.rsplit(".", 1)[-1] for p in paths]
    return {p: (n if last.count(n) == 1 else p) for p, n in zip(paths, last)}


def trial_id(index: int, width: int, values: dict[str, Any], seed: int | None) -> str:
    """``t003-lr=0.001-n_heads=4-seed=1``: the index (unique on its own) and the values."""
    names = short_names(list(values))
    parts = [f"t{index:0{width}d}"]
    parts += [f"{names[p]}={value_label(v)}" for p, v in values.items()]
    if seed is not None:
        parts.append(f"seed={seed}")
    text = _UNSAFE.sub("_", "-".join(parts))
    return text[:MAX_ID_LENGTH].rstrip("_-.")


def configurations(sweep: SweepFile) -> list[dict[str, Any]]:
    """Every configuration (spec path -> value) in order, before seeds."""
    if sweep.random is not None:
        rng = random.Random(sweep.random.seed)
        return [
            {p: d.draw(rng) for p, d in sweep.random.axes.items()}
            for _ in range(sweep.random.samples)
        ]
    dims: list[list[dict[str, Any]]] = [
        [{path: v} for v in axis_values(axis)] for path, axis in sweep.axes.items()
    ]
    for group in sweep.zipped:
        columns = {p: axis_values(a) for p, a in group.items()}
        n = len(next(iter(columns.values())))
        dims.append([{p: vs[i] for p, vs in columns.items()} for i in range(n)])
    return [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*dims)]


def expand(sweep: SweepFile, sets: list[str] | None = None) -> list[Trial]:
    """The sweep's trials: each configuration once per seed (seeds vary fastest). ``sets``:
    command-line ``--set`` overrides, after the file's ``set`` and before the axes."""
    # counted again here: a model built without validation, and the command line's --set
    too_many = trial_count_problem(sweep) or override_bytes_problem(sweep, sets)
    if too_many:
        raise LlmkitError(too_many)
    configs = configurations(sweep)
    seeds: list[int | None] = list(sweep.seeds) if sweep.seeds is not None else [None]
    n = len(configs) * len(seeds)
    width = max(3, len(str(n - 1)))
    trials = []
    for index, (values, seed) in enumerate(itertools.product(configs, seeds)):
        overrides = [*sweep.overrides, *(sets or [])]
        overrides += [f"{p}={toml_literal(v)}" for p, v in values.items()]
        if seed is not None:
            overrides.append(f"train.seed={seed}")
        trials.append(Trial(index, trial_id(index, width, values, seed), values, seed, overrides))
    return trials


def axis_paths(sweep: SweepFile) -> list[str]:
    """Every path the sweep varies, in file order."""
    if sweep.random is not None:
        return list(sweep.random.axes)
    return [*sweep.axes, *(p for g in sweep.zipped for p in g)]


def varied_paths(sweep: SweepFile) -> list[str]:
    """Every path the sweep's trials differ in: its axes, and ``train.seed`` under ``seeds``."""
    return [*axis_paths(sweep), *(["train.seed"] if sweep.seeds is not None else [])]


def log_axes(sweep: SweepFile) -> set[str]:
    """The paths whose values are log-spaced (plotted on a log x axis)."""
    if sweep.random is not None:
        return {p for p, d in sweep.random.axes.items() if d.log}
    groups = [sweep.axes, *sweep.zipped]
    return {p for g in groups for p, a in g.items() if isinstance(a, LogRange)}


def zip_partners(sweep: SweepFile) -> dict[str, set[str]]:
    """For each path, the paths that vary with it (its zip group, itself included)."""
    out = {p: {p} for p in axis_paths(sweep)}
    for group in sweep.zipped:
        for p in group:
            out[p] = set(group)
    return out
