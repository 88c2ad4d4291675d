"""The distributions a random sweep draws from and a search samples: one vocabulary for both.

A distribution is a table with exactly one of these keys (docs/experiments.md):

=====================================  =================================================
``{log_uniform = [lo, hi]}``           a float, uniform in log space (0 < lo < hi)
``{uniform = [lo, hi]}``               a float, uniform; ``step = s``: one of lo, lo+s, …
``{int = [lo, hi]}``                   an integer, each equally likely; ``step = k``: one
                                       of lo, lo+k, …; ``log = true``: uniform in log space
``{choice = [a, b, …]}``               one of the values (any value ``--set`` takes)
=====================================  =================================================

Each distribution is validated once, here, and serves both samplers: :meth:`draw` takes a
:class:`random.Random` (``llmkit sweep``'s ``[random]``, reproducible from its seed) and
:meth:`suggest` an Optuna trial (``llmkit search``), over the same values. :meth:`ends` are
the values that must all be valid settings (checked before anything runs) and :meth:`grid`
every value when there are finitely many.
"""

from __future__ import annotations

import math
import random
from typing import Annotated, Any, ClassVar, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

#: Random draws of floats are rounded to this many significant digits (trial ids and
#: ``--set`` values stay short); Optuna's suggestions are kept as they come.
SAMPLE_DIGITS = 6
#: Stepped float values are rounded to this many significant digits: ``0.1 + 2 · 0.1`` is 0.3.
GRID_DIGITS = 12
#: The most values a ``choice`` may list: every one is resolved and checked before a search
#: or sweep runs anything.
MAX_CHOICES = 10_000
#: Integer ranges stay within a 64-bit integer (what a spec's integers and Optuna hold).
INT_LIMIT = 2**63


def check_value(value: Any) -> Any:
    """A value ``--set`` can write: numbers, strings, booleans, lists and tables of them."""
    if value is None:
        raise ValueError("null cannot be set through --set; leave the key out instead")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} is not a finite number")
    if isinstance(value, list):
        for v in value:
            check_value(v)
    elif isinstance(value, dict):
        for v in value.values():
            check_value(v)
    elif not isinstance(value, bool | int | float | str):
        raise ValueError(f"{value!r} is not a value a spec holds")
    return value


def _check_values(values: list[Any]) -> list[Any]:
    for v in values:
        check_value(v)
    return values


#: A non-empty list of values ``--set`` can write.
ValueList = Annotated[list[Any], Field(min_length=1), AfterValidator(_check_values)]


class _Distribution(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    #: The key naming the distribution in a file.
    KEY: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _no_integer_flag(cls, data: Any) -> Any:
        if isinstance(data, dict) and "integer" in data:
            raise ValueError(
                "integers are drawn by {int = [lo, hi]} (log = true: log-uniformly), "
                "not `integer = true`"
            )
        return data

    @property
    def log(self) -> bool:
        """Whether its values spread in log space (plotted on a log axis)."""
        return False

    def draw(self, rng: random.Random) -> Any:
        """One value drawn with ``rng`` (a random sweep)."""
        raise NotImplementedError

    def suggest(self, trial: Any, name: str) -> Any:
        """One value suggested by the Optuna ``trial`` for parameter ``name`` (a search)."""
        raise NotImplementedError

    def ends(self) -> list[Any]:
        """Values that must all be valid settings: the range's ends, or every choice."""
        raise NotImplementedError

    def grid(self) -> list[Any] | None:
        """Every value it can take, in order, or None when they are not finitely many."""
        return None


def _ordered(lo: float, hi: float) -> None:
    if not lo < hi:
        raise ValueError(f"the range {[lo, hi]} must go from low to high")
    if isinstance(lo, float) and not math.isfinite(hi - lo):
        raise ValueError(f"the range {[lo, hi]} is wider than a float holds (hi - lo overflows)")


def _round(value: float, digits: int) -> float:
    return float(f"{value:.{digits}g}")


class LogUniform(_Distribution):
    """``{log_uniform = [lo, hi]}``: a float drawn uniformly in log space (0 < lo < hi)."""

    KEY: ClassVar[str] = "log_uniform"
    log_uniform: tuple[float, float] = Field(description="The lowest and highest value, > 0.")

    @model_validator(mode="after")
    def _range(self) -> LogUniform:
        _ordered(*self.log_uniform)
        if self.log_uniform[0] <= 0:
            raise ValueError("log_uniform needs a positive low end")
        return self

    @property
    def log(self) -> bool:
        return True

    def draw(self, rng: random.Random) -> float:
        lo, hi = (math.log(v) for v in self.log_uniform)
        return _round(math.exp(rng.uniform(lo, hi)), SAMPLE_DIGITS)

    def suggest(self, trial: Any, name: str) -> float:
        return float(trial.suggest_float(name, *self.log_uniform, log=True))

    def ends(self) -> list[Any]:
        return list(self.log_uniform)


class Uniform(_Distribution):
    """``{uniform = [lo, hi]}``: a float drawn uniformly; with ``step``, one of lo, lo+step,
    … up to hi, each equally likely."""

    KEY: ClassVar[str] = "uniform"
    uniform: tuple[float, float] = Field(description="The lowest and highest value.")
    step: float | None = Field(None, gt=0, description="Only values lo + k·step (≤ hi).")

    @model_validator(mode="after")
    def _range(self) -> Uniform:
        _ordered(*self.uniform)
        if self.step is not None and self.step > self.uniform[1] - self.uniform[0]:
            raise ValueError(f"step {self.step} is wider than the range {list(self.uniform)}")
        if self.step is not None and (self.uniform[1] - self.uniform[0]) / self.step >= INT_LIMIT:
            raise ValueError(
                f"step {self.step} is too small for the range {list(self.uniform)} "
                "(2**63 steps or more)"
            )
        return self

    def _count(self) -> int:
        """How many steps fit above lo (a hair of tolerance for float division)."""
        assert self.step is not None
        lo, hi = self.uniform
        return math.floor((hi - lo) / self.step + 1e-9)

    def _at(self, k: int) -> float:
        assert self.step is not None
        return _round(self.uniform[0] + k * self.step, GRID_DIGITS)

    def draw(self, rng: random.Random) -> float:
        if self.step is not None:
            return self._at(rng.randint(0, self._count()))
        return _round(rng.uniform(*self.uniform), SAMPLE_DIGITS)

    def suggest(self, trial: Any, name: str) -> float:
        lo, hi = self.ends()
        return float(trial.suggest_float(name, lo, hi, step=self.step))

    def ends(self) -> list[Any]:
        if self.step is None:
            return list(self.uniform)
        return [self.uniform[0], self._at(self._count())]

    def grid(self) -> list[Any] | None:
        if self.step is None:
            return None
        return [self._at(k) for k in range(self._count() + 1)]


class Int(_Distribution):
    """``{int = [lo, hi]}``: an integer, every one of lo … hi equally likely; ``step = k``:
    one of lo, lo+k, … ≤ hi; ``log = true``: drawn uniformly in log space (lo ≥ 1)."""

    KEY: ClassVar[str] = "int"
    integers: tuple[int, int] = Field(alias="int", description="The lowest and highest value.")
    step: int | None = Field(None, ge=1, description="Only values lo + k·step (≤ hi).")
    log_scale: bool = Field(
        False, alias="log", description="Draw in log space (lo ≥ 1; no step beside it)."
    )

    @model_validator(mode="after")
    def _range(self) -> Int:
        lo, hi = self.integers
        _ordered(lo, hi)
        if lo < -INT_LIMIT or hi >= INT_LIMIT:
            raise ValueError(f"the range {[lo, hi]} must lie within [-2**63, 2**63)")
        if self.log_scale and lo < 1:
            raise ValueError("int with log = true needs a low end ≥ 1")
        if self.log_scale and self.step is not None:
            raise ValueError("int takes log = true or a step, not both")
        if self.step is not None and self.step > hi - lo:
            raise ValueError(f"step {self.step} is wider than the range {[lo, hi]}")
        return self

    @property
    def log(self) -> bool:
        return self.log_scale

    def _top(self) -> int:
        lo, hi = self.integers
        step = self.step or 1
        return lo + (hi - lo) // step * step

    def draw(self, rng: random.Random) -> int:
        lo, hi = self.integers
        if self.log_scale:
            # Each integer k gets the log-width of [k − ½, k + ½] (the ends included whole).
            value = math.exp(rng.uniform(math.log(lo - 0.5), math.log(hi + 0.5)))
            return min(max(round(value), lo), hi)
        step = self.step or 1
        return lo + step * rng.randint(0, (hi - lo) // step)

    def suggest(self, trial: Any, name: str) -> int:
        lo = self.integers[0]
        return int(trial.suggest_int(name, lo, self._top(), step=self.step or 1, log=self.log))

    def ends(self) -> list[Any]:
        return [self.integers[0], self._top()]

    def grid(self) -> list[Any] | None:
        return list(range(self.integers[0], self._top() + 1, self.step or 1))


class Choice(_Distribution):
    """``{choice = [a, b, ...]}``: one of the values, each equally likely."""

    KEY: ClassVar[str] = "choice"
    choice: ValueList = Field(
        max_length=MAX_CHOICES, description="The values (any value --set takes)."
    )

    def draw(self, rng: random.Random) -> Any:
        return rng.choice(self.choice)

    def suggest(self, trial: Any, name: str) -> Any:
        return trial.suggest_categorical(name, self.choice)

    def ends(self) -> list[Any]:
        return list(self.choice)

    def grid(self) -> list[Any] | None:
        return list(self.choice)


#: Every distribution by its key.
DISTRIBUTIONS: dict[str, type[_Distribution]] = {
    d.KEY: d for d in (LogUniform, Uniform, Int, Choice)
}
#: The one-line error for a table naming no distribution, or several.
EXACTLY_ONE = (
    "give exactly one of log_uniform, uniform, int, choice: {log_uniform = [lo, hi]}, "
    "{uniform = [lo, hi]}, {int = [lo, hi]} or {choice = [values]}"
)


def _kind(value: Any) -> str | None:
    if isinstance(value, _Distribution):
        return value.KEY
    if isinstance(value, dict):
        given = [k for k in DISTRIBUTIONS if k in value]
        return given[0] if len(given) == 1 else None
    return None


#: One distribution: a sweep's random axis, a search's parameter.
Distribution = Annotated[
    Union[  # noqa: UP007
        Annotated[LogUniform, Tag("log_uniform")],
        Annotated[Uniform, Tag("uniform")],
        Annotated[Int, Tag("int")],
        Annotated[Choice, Tag("choice")],
    ],
    Discriminator(_kind, custom_error_type="distribution", custom_error_message=EXACTLY_ONE),
]


def table_keys(model: type[BaseModel]) -> list[str]:
    """The keys a table of ``model`` takes, as written in a file."""
    return [f.alias or name for name, f in model.model_fields.items()]
