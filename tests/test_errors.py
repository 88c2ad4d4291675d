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
