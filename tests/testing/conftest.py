"""Tests of the conformance suite (llmkit.testing)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs on one thread (tests/conftest.py)."""
