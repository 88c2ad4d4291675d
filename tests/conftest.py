"""Test set-up: installed third-party plugins are not loaded unless a test asks for them."""

from __future__ import annotations

import os

os.environ["LLMKIT_PLUGINS"] = ""  # only the built-in plugin
os.environ.pop("LLMKIT_STRICT_PLUGINS", None)
os.environ.pop("LLMKIT_REGISTRY", None)

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


@pytest.fixture
def fresh_registry():
    """A process registry reloaded from scratch, dropped again afterwards."""
    from llmkit.registry import reset_registry

    reset_registry()
    yield
    reset_registry()
