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
    assert {c.kind for c in reg.list(None, "rms*")} == {"norm", "qk_transform"}
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


# -- a plugin that fails partway is rolled back; lookups name it --------------------------------


class Partway:
    """Declares a kind, registers three components (one clashing with a built-in), then raises."""

    distribution = "llmkit-partway"
    name = "partway"

    @hookimpl
    def register_kinds(self, register):
        register("metric", "Evaluation metrics")

    @hookimpl
    def register_components(self, register):
        register("norm", "early_norm", Fancy)
        register("attention", "sdpa", Fancy)
        register("metric", "accuracy", Fancy)
        raise RuntimeError("boom halfway")


PARTWAY = (
    "plugin 'partway' (llmkit-partway) provides it but failed to load: "
    "register_components: RuntimeError: boom halfway"
)


def test_a_plugin_failing_partway_registers_nothing():
    reg = registry_with(Partway(), FakePlugin())
    (failed,) = reg.failures()
    assert failed.name == "partway" and failed.registered == []
    assert "metric" not in reg.kinds
    assert reg.get("attention", "sdpa").provider == "llmkit"  # its clash is undone too
    assert not reg.conflicts and not reg.overridden
    assert reg.get("ffn", "fancy").provider == "llmkit-fake"  # the next plugin is unaffected
    with pytest.raises(RegistryError) as err:
        reg.get("norm", "early_norm")
    assert str(err.value).startswith("unknown norm 'early_norm'")
    assert PARTWAY in str(err.value)
    with pytest.raises(RegistryError, match="unknown component kind 'metric'") as err:
        reg.get("metric", "accuracy")
    assert PARTWAY in str(err.value)


def test_a_plugin_failing_in_register_kinds_registers_no_component():
    class BadKinds:
        @hookimpl
        def register_kinds(self, register):
            register("metric", "Evaluation metrics")
            raise RuntimeError("no more kinds")

        @hookimpl
        def register_components(self, register):
            register("norm", "never", Fancy)

    reg = registry_with(BadKinds())
    (failed,) = reg.failures()
    assert "register_kinds: RuntimeError: no more kinds" in failed.error
    assert "metric" not in reg.kinds and "norm.never" not in reg.components


def test_an_unknown_name_lists_the_plugins_that_failed():
    class ImportLike:
        @hookimpl
        def register_components(self, register):
            raise ImportError("no module named 'bar'")

    reg = registry_with(ImportLike())
    with pytest.raises(RegistryError) as err:
        reg.get("ffn", "nope")
    msg = str(err.value)
    assert msg.startswith("unknown ffn 'nope'") and "\n" not in msg
    assert (
        "plugin 'fake0' (fake-0) failed to load and may provide it: "
        "register_components: ImportError: no module named 'bar'"
    ) in msg
    assert registry_with().failure_hint("ffn", "nope") == ""  # nothing failed: no hint


PARTWAY_PLUGIN = Partway()
USES_METRIC = SimpleNamespace(
    register_components=hookimpl(
        lambda register: (
            register("metric", "f1", Fancy),
            register("norm", "other_norm", Fancy),
        )
    )
)


@pytest.mark.parametrize("user", ["aaa_user", "zzz_user"])
def test_components_of_a_rolled_back_kind_go_whatever_the_order(monkeypatch, user):
    real = [ep for ep in md.entry_points(group="llmkit") if ep.name == "builtin"]
    fakes = [
        _entry_point("partway", "tests.test_registry:PARTWAY_PLUGIN"),
        _entry_point(user, "tests.test_registry:USES_METRIC"),
    ]
    monkeypatch.setattr(md, "entry_points", lambda group: real + fakes)
    reg = Registry()
    reg.load_entry_points(None)
    assert [f.name for f in reg.failures()] == ["partway"]
    assert reg.plugins[user].registered == ["norm.other_norm"]
    assert reg.get("norm", "other_norm") and "metric.f1" not in reg.components
    with pytest.raises(RegistryError, match="plugin 'partway'"):
        reg.get("metric", "f1")


def test_the_module_level_failure_hint_reads_the_process_registry():
    from llmkit import registry as registry_module

    reset_registry(registry_with(Partway()))
    try:
        assert registry_module.failure_hint("norm", "early_norm") == f"; {PARTWAY}"
    finally:
        reset_registry()


# -- a registry file with a bad [winners] table ------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("winners = 5\n", '[winners] must be a table of "kind.name" = "distribution", got 5'),
        ('[winners]\n"norm.dyt" = 5\n', '[winners] "norm.dyt": expected a distribution name'),
        ('[winners]\n"norm.dyt" = ["a"]\n', '[winners] "norm.dyt": expected a distribution'),
        ('[winners]\n"dyt" = "llmkit"\n', '[winners] "dyt": expected a key "kind.name"'),
    ],
    ids=["not-a-table", "a-number", "a-list", "no-kind"],
)
def test_a_bad_winners_table_is_one_line_naming_the_file_and_key(
    tmp_path, monkeypatch, text, message
):
    from llmkit.registry import _load_winners

    path = tmp_path / "mine.toml"
    path.write_text(text)
    monkeypatch.setenv("LLMKIT_REGISTRY", str(path))
    with pytest.raises(RegistryError) as err:
        _load_winners()
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_bad_winners_table_is_a_one_line_cli_error(tmp_path, monkeypatch, capsys):
    from llmkit.cli import main

    path = tmp_path / "mine.toml"
    path.write_text("winners = 5\n")
    monkeypatch.setenv("LLMKIT_REGISTRY", str(path))
    reset_registry()
    try:
        code = main(["list"])
    finally:
        reset_registry()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert str(path) in err and "[winners]" in err


def test_an_unknown_spec_table_names_the_plugins_that_failed():
    """A table whose kind only a failed plugin would have declared (``train.loss``) is an
    unknown key; the error says which plugin failed."""
    from llmkit.errors import SpecError
    from llmkit.spec import resolve
    from tests.helpers import tiny_spec

    class ImportLike:
        @hookimpl
        def register_kinds(self, register):
            raise ImportError("no module named 'losses'")

    data = {**tiny_spec(), "train": {"loss": {"name": "z_loss"}}}
    with pytest.raises(SpecError) as err:
        resolve(data, registry=registry_with(ImportLike()))
    msg = str(err.value)
    assert "train.loss: unknown key" in msg and "plugin 'fake0' (fake-0) failed to load" in msg
    with pytest.raises(SpecError) as err:
        resolve(data, registry=registry_with())
    assert "failed to load" not in str(err.value)
