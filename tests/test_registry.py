"""The registry: plugin loading, isolation of failures, conflicts, lookups."""

from __future__ import annotations

import importlib.metadata as md
from types import SimpleNamespace

import pytest
from pydantic import Field

from llmkit import hookimpl
from llmkit.contracts import ComponentOptions
from llmkit.errors import PluginError, RegistryError
from llmkit.registry import Registry, get_registry, reset_registry
from tests.helpers import registry_with


class FancyOptions(ComponentOptions):
    scale: float = Field(1.0, gt=0)


class Fancy:
    """A fancy thing."""

    Options = FancyOptions


class FakePlugin:
    distribution = "llmkit-fake"
    name = "fake"

    def __init__(self, kind: str = "ffn", cname: str = "fancy") -> None:
        self.kind, self.cname = kind, cname

    @hookimpl
    def register_components(self, register):
        register(self.kind, self.cname, Fancy, capabilities={"x": 1})


def test_builtin_plugin_registers_every_kind_through_the_hook(fresh_registry):
    reg = get_registry()
    assert set(reg.kinds) >= {"attention", "ffn", "norm", "position", "optimizer", "schedule"}
    assert reg.plugins["builtin"].distribution == "llmkit"
    assert "attention.sdpa" in reg.plugins["builtin"].registered
    rec = reg.get("attention", "sdpa")
    assert rec.provider == "llmkit"
    assert isinstance(rec.target, str)  # lazy until used


def test_inline_plugin_registers_a_record_with_provider_and_summary():
    reg = registry_with(FakePlugin())
    rec = reg.get("ffn", "fancy")
    assert rec.provider == "llmkit-fake" and rec.version == "1.0"
    assert rec.summary == "A fancy thing."  # from the docstring when not given
    assert rec.capabilities == {"x": 1}
    assert rec.options_model() is FancyOptions
    assert rec.parse_options({"scale": 2.0}).scale == 2.0
    assert reg.plugins["fake"].registered == ["ffn.fancy"]


def test_unknown_name_lists_what_exists_and_suggests_the_nearest():
    reg = registry_with()
    with pytest.raises(RegistryError) as err:
        reg.get("attention", "sdp")
    msg = str(err.value)
    assert "did you mean 'sdpa'" in msg and "dense" in msg and "sliding_window" in msg
    with pytest.raises(RegistryError, match="did you mean 'attention'"):
        reg.get("atention", "sdpa")


def test_wildcard_listing():
    reg = registry_with()
    assert [c.name for c in reg.list("attention", "s*")] == ["sdpa", "sliding_window"]
    assert {c.kind for c in reg.list(None, "rms*")} == {"norm"}
    assert all(c.name.endswith("norm") for c in reg.list(None, "*norm"))


def test_duplicate_is_an_error_naming_both_providers():
    a, b = FakePlugin(), FakePlugin()
    b.distribution, b.name = "llmkit-other", "other"
    reg = registry_with(a, b)
    with pytest.raises(RegistryError) as err:
        reg.get("ffn", "fancy")
    assert "llmkit-fake" in str(err.value) and "llmkit-other" in str(err.value)
    assert reg.conflicts["ffn.fancy"].winner is None


def test_duplicate_of_a_builtin_names_both(monkeypatch):
    reg = registry_with(FakePlugin("attention", "sdpa"))
    with pytest.raises(RegistryError, match="llmkit and llmkit-fake"):
        reg.get("attention", "sdpa")


def test_registry_file_chooses_the_winner(tmp_path, monkeypatch):
    user = tmp_path / "mine.toml"
    user.write_text('[winners]\n"ffn.fancy" = "llmkit-other"\n')
    monkeypatch.setenv("LLMKIT_REGISTRY", str(user))
    from llmkit.registry import _load_winners

    a, b = FakePlugin(), FakePlugin()
    b.distribution, b.name = "llmkit-other", "other"
    reg = Registry()
    reg.winners = _load_winners()
    from llmkit.components import builtin

    reg.add_plugin(builtin, "builtin", "llmkit", "0")
    reg.add_plugin(a, "fake", "llmkit-fake", "1")
    reg.add_plugin(b, "other", "llmkit-other", "1")
    assert reg.get("ffn", "fancy").provider == "llmkit-other"
    assert reg.conflicts["ffn.fancy"].winner == "llmkit-other"
    assert [c.provider for c in reg.overridden] == ["llmkit-fake"]


@pytest.mark.parametrize("what", ["missing", "directory", "not-utf8", "bad-toml"])
def test_a_registry_file_that_cannot_be_used_is_named(tmp_path, monkeypatch, what):
    from llmkit.registry import _load_winners

    path = {"missing": tmp_path / "nope.toml", "directory": tmp_path}.get(what, tmp_path / "r.toml")
    if what == "not-utf8":
        path.write_bytes(b"\xff\xfe")
    elif what == "bad-toml":
        path.write_text("[winners\n")
    monkeypatch.setenv("LLMKIT_REGISTRY", str(path))
    with pytest.raises(RegistryError, match=str(path)):
        _load_winners()


def test_a_plugin_failing_to_register_is_reported_and_others_still_load():
    class Broken:
        @hookimpl
        def register_components(self, register):
            raise RuntimeError("boom")

    reg = registry_with(Broken(), FakePlugin())
    failed = reg.failures()
    assert [f.name for f in failed] == ["fake0"]
    assert "boom" in failed[0].error
    assert reg.get("ffn", "fancy")  # the other plugin loaded


def test_misspelled_hook_is_caught_by_check_pending():
    class Typo:
        @hookimpl
        def register_component(self, register):  # missing "s"
            register("ffn", "typo", Fancy)

    reg = registry_with(Typo())
    (failed,) = reg.failures()
    assert "register_component" in failed.error


def test_unknown_kind_is_refused_with_the_known_kinds():
    reg = registry_with(FakePlugin("attn", "x"))
    (failed,) = reg.failures()
    assert "unknown kind 'attn'" in failed.error and "attention" in failed.error


def test_plugins_can_declare_new_kinds():
    class Kinds:
        @hookimpl
        def register_kinds(self, register):
            register("loss", "Training loss functions")

        @hookimpl
        def register_components(self, register):
            register("loss", "xent", Fancy, summary="cross-entropy")

    reg = registry_with(Kinds())
    assert reg.kinds["loss"].summary == "Training loss functions"
    assert reg.get("loss", "xent").summary == "cross-entropy"


def _entry_point(name: str, value: str) -> md.EntryPoint:
    return md.EntryPoint(name=name, value=value, group="llmkit")


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Installed plugins: the real built-in one, one that cannot import, one that works."""
    real = [ep for ep in md.entry_points(group="llmkit") if ep.name == "builtin"]
    fakes = [
        _entry_point("broken", "llmkit_no_such_plugin_module"),
        _entry_point("good", "tests.test_registry:GOOD_PLUGIN"),
    ]
    monkeypatch.setattr(md, "entry_points", lambda group: real + fakes)


GOOD_PLUGIN = SimpleNamespace(
    register_components=hookimpl(lambda register: register("norm", "good_norm", Fancy))
)


def test_entry_point_that_fails_to_import_is_reported_by_name(fake_entry_points):
    reg = Registry()
    reg.load_entry_points(None)
    assert reg.plugins["broken"].error.startswith("ModuleNotFoundError")
    assert reg.get("norm", "good_norm")
    assert reg.get("attention", "sdpa")


def test_strict_mode_reraises(fake_entry_points, monkeypatch):
    monkeypatch.setenv("LLMKIT_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="broken"):
        Registry().load_entry_points(None)


def test_allow_list_limits_which_plugins_load(fake_entry_points, monkeypatch):
    reg = Registry()
    reg.load_entry_points([])  # '' = none besides the built-in one
    assert set(reg.plugins) == {"builtin"}
    reg = Registry()
    reg.load_entry_points(["good"])
    assert set(reg.plugins) == {"builtin", "good"}


def test_env_allow_list_is_read(fake_entry_points, monkeypatch):
    monkeypatch.setenv("LLMKIT_PLUGINS", "good")
    reset_registry()
    try:
        assert set(get_registry().plugins) == {"builtin", "good"}
    finally:
        reset_registry()


def test_a_missing_builtin_entry_point_is_reported_not_imported_by_name(monkeypatch):
    """The registry never names a component module: without llmkit's own entry point (llmkit
    not installed) the built-in plugin is a reported failure."""
    monkeypatch.setattr(md, "entry_points", lambda group: [])
    reg = Registry()
    reg.load_entry_points([])
    (failed,) = reg.failures()
    assert failed.name == "builtin" and "llmkit is not installed" in failed.error
    assert not reg.components
