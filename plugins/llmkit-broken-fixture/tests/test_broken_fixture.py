"""Installed (throwaway, see conftest.py), its entry point exists, and loading it fails,
reported by name."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from llmkit import PluginError, Registry


def test_it_is_not_installed_in_the_environment():
    with pytest.raises(md.PackageNotFoundError):
        md.distribution("llmkit-broken-fixture")


def test_the_throwaway_install_has_the_entry_point(installed):
    (ep,) = [e for e in md.entry_points(group="llmkit") if e.name == "broken_fixture"]
    assert ep.value == "llmkit_broken_fixture"
    assert ep.dist is not None and ep.dist.metadata["Name"] == "llmkit-broken-fixture"


def test_importing_it_raises(installed):
    with pytest.raises(RuntimeError, match="test fixture that always fails to import"):
        import llmkit_broken_fixture  # noqa: F401


def test_the_registry_reports_it_and_keeps_working(installed, monkeypatch):
    monkeypatch.delenv("LLMKIT_STRICT_PLUGINS", raising=False)
    reg = Registry()
    reg.load_entry_points(["broken_fixture"])
    info = reg.plugins["broken_fixture"]
    assert info.distribution == "llmkit-broken-fixture" and info.version == "0.1.0"
    assert info.error.startswith("RuntimeError: llmkit-broken-fixture is a test fixture")
    assert info.registered == []
    assert [f.name for f in reg.failures()] == ["broken_fixture"]
    assert reg.get("attention", "sdpa")  # the built-in plugin still loaded


def test_strict_mode_raises_naming_it(installed, monkeypatch):
    monkeypatch.setenv("LLMKIT_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=r"plugin 'broken_fixture' \(llmkit-broken-fixture\)"):
        Registry().load_entry_points(["broken_fixture"])
