"""User-facing error helpers."""

from __future__ import annotations

import pytest

from llmkit.errors import first_line


@pytest.mark.parametrize(
    "exc,want",
    [
        (ValueError("bad value\n  at line 3"), "bad value"),
        (OSError("\n  leading blank line\nmore"), "leading blank line"),
        (KeyError(), "KeyError"),
        (RuntimeError("   "), "RuntimeError"),
    ],
)
def test_first_line_is_the_first_non_empty_line_or_the_type(exc: BaseException, want: str):
    assert first_line(exc) == want


def test_first_line_takes_text_a_type_prefix_and_a_limit():
    assert first_line("\n  one\ntwo") == "one" and first_line("  ") == ""
    assert first_line(KeyError("k"), typed=True) == "KeyError: 'k'"
    assert first_line(RuntimeError(), typed=True) == "RuntimeError"
    assert first_line("abcdef", limit=4) == "abc…" and first_line("abcd", limit=4) == "abcd"


def test_validation_problems_give_paths_and_options():
    from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

    from llmkit.errors import validation_problems

    class Inner(BaseModel):
        model_config = ConfigDict(extra="forbid")
        size: int = 1

    class Outer(BaseModel):
        model_config = ConfigDict(extra="forbid")
        items: list[Inner] = []

        @field_validator("items")
        @classmethod
        def _some(cls, v: list[Inner]) -> list[Inner]:
            if len(v) > 2:
                raise ValueError("at most two")
            return v

    with pytest.raises(ValidationError) as info:
        Outer.model_validate({"items": [{"size": "x", "sise": 2}]})
    exc = info.value
    assert validation_problems(exc) == [
        "items[0].size: Input should be a valid integer, unable to parse string as an integer",
        "items[0].sise: Extra inputs are not permitted",
    ]
    unknown = validation_problems(
        exc, prefix=("a.b",), quote_dotted=True, allowed=lambda _: ["size"]
    )
    assert (
        unknown[1] == "[\"a.b\"].items[0].sise: unknown key; did you mean 'size'? (allowed: size)"
    )
    assert validation_problems(exc, sep="; ").count("; ") == 1
    with pytest.raises(ValidationError) as info:
        Outer.model_validate({"items": [{}, {}, {}]})
    assert validation_problems(info.value) == ["items: at most two"]  # no "Value error, "
    with pytest.raises(ValidationError) as info:
        Outer.model_validate(3)
    assert validation_problems(info.value)[0].startswith("(top level): ")
    assert validation_problems(info.value, top=None)[0].startswith("Input should be")
