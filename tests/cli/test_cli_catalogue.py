"""list, show, plugins, validate and schema."""

from __future__ import annotations

import json

import pytest

from llmkit.cli import main
from llmkit.registry import reset_registry
from tests.conftest import SPECS


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_with_kind_and_wildcards(capsys):
    code, out, _ = run(capsys, "list", "attention")
    assert code == 0 and "sdpa" in out and "mlp" not in out
    code, out, _ = run(capsys, "list", "position", "r*")
    assert "rope" in out and "learned" not in out
    code, out, _ = run(capsys, "list", "*norm")
    assert "rmsnorm" in out and "layernorm" in out and "sdpa" not in out


def test_unknown_kind_is_a_one_line_error(capsys):
    code, _, err = run(capsys, "list", "atention")
    assert code == 2
    assert err.strip().count("\n") == 0 and "did you mean 'attention'" in err


def test_show_prints_options_provider_and_capabilities(capsys):
    code, out, _ = run(capsys, "show", "attention", "sliding_window")
    assert code == 0
    for text in ("window", "256", "llmkit", "causal_only", "capabilities"):
        assert text in out
    code, _, err = run(capsys, "show", "ffn", "swigl")
    assert code == 2 and "did you mean 'swiglu'" in err


@pytest.fixture
def ghost_registry():
    """The process registry with a component whose module does not import."""
    from llmkit import hookimpl
    from tests.helpers import registry_with

    class Ghost:
        distribution, name = "llmkit-fake", "fake"

        @hookimpl
        def register_components(self, register):
            register("norm", "ghost", "llmkit.no_such_module:Ghost")

    reset_registry(registry_with(Ghost()))
    yield
    reset_registry()


def test_show_names_a_component_whose_module_fails_to_import(capsys, ghost_registry):
    code, out, err = run(capsys, "show", "norm", "ghost")
    assert code == 2 and not out
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "norm 'ghost' from llmkit-fake failed to load: ModuleNotFoundError" in err


def test_plugins_lists_the_builtin_plugins(capsys):
    code, out, _ = run(capsys, "plugins", "-v")
    assert code == 0 and "builtin" in out and "attention.sdpa" in out
    assert "builtin-cli" in out and "command 'bench kernels'" in out
    code, out, _ = run(capsys, "plugins", "--json")
    plugins = {p["name"]: p for p in json.loads(out)["plugins"]}
    assert plugins["builtin"]["kinds"] == [] and plugins["builtin-cli"]["kinds"] == []
    assert {"list", "plugin new", "bench generate"} <= set(plugins["builtin-cli"]["commands"])


def test_validate_good_and_bad(capsys, tmp_path):
    code, out, err = run(capsys, "validate", str(SPECS / "tiny.toml"), "--resolved")
    assert code == 0 and "valid (model not built; --build checks it)" in err
    assert json.loads(out)["model"]["layers"]  # stdout is the JSON alone
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nd_model = 8\nn_layers = 1\nn_heads = 2\nffn = { name = "mpl" }\n')
    code, _, err = run(capsys, "validate", str(bad))
    assert code == 2 and "model.ffn.name" in err and "did you mean 'mlp'" in err


def test_validate_builds_the_model_to_find_what_only_components_know(capsys):
    argv = ["validate", str(SPECS / "tiny.toml"), "--set", "model.head_dim=7"]
    code, out, err = run(capsys, *argv, "--build")
    assert code == 2 and not out
    assert "the model does not build: position 'rope'" in err and "rot_dim 7" in err
    code, out, _ = run(capsys, *argv)  # without --build: the spec is valid, the model unbuilt
    assert code == 0
    assert "tiny.toml: 4 layers, valid (model not built; --build checks it)" in out
    code, out, _ = run(capsys, "validate", str(SPECS / "tiny.toml"), "--build")
    assert code == 0 and "tiny.toml: 4 layers, valid, the model builds" in out


def test_show_describes_a_component_without_importing_it_unless_asked(capsys):
    """The catalogue's summary and the options' docstring describe a built-in component; with
    --runtime its module is imported: its own docstring, and for a kernel the path it takes."""
    code, out, _ = run(capsys, "show", "optimizer", "lion")
    assert code == 0 and "Lion: sign-of-momentum updates" in out
    assert "Use an lr 3-10× smaller" in out  # the options' docstring
    code, out, _ = run(capsys, "show", "attention", "flash", "--runtime")
    assert code == 0 and "Fused flash-attention Triton kernel (FlashAttention-2, Dao 2023)" in out
    assert "runtime: attention.flash: " in out


def test_schema_writes_json(tmp_path):
    target = tmp_path / "schema.json"
    assert main(["schema", "-o", str(target)]) == 0
    assert json.loads(target.read_text())["title"] == "llmkit spec"


def test_schema_leaves_out_a_component_whose_module_fails_to_import(
    capsys, tmp_path, ghost_registry
):
    target = tmp_path / "schema.json"
    code, _, err = run(capsys, "schema", "-o", str(target))
    assert code == 0, err
    defs = json.loads(target.read_text())["$defs"]
    assert "norm__ghost" not in defs and "norm__rmsnorm" in defs
    assert "warning: schema: left out norm 'ghost' from llmkit-fake" in err
    assert "failed to load: ModuleNotFoundError" in err and "Traceback" not in err


@pytest.fixture
def partway_failed():
    """The process registry with a plugin that raised partway through register_components."""
    from tests.helpers import registry_with
    from tests.test_registry import Partway

    reset_registry(registry_with(Partway()))
    yield
    reset_registry()


PARTWAY = "plugin 'partway' (llmkit-partway) provides it but failed to load: register_components"


def test_commands_name_the_failed_plugin_a_spec_asks_for(capsys, tmp_path, partway_failed):
    code, _, err = run(capsys, "show", "norm", "early_norm")
    # every command first names the failed plugin (one warning line), then the error: one line
    warning, error = err.strip().splitlines()
    assert warning.startswith("warning: plugin 'partway' (llmkit-partway) failed: ")
    assert code == 2 and "unknown norm 'early_norm'" in error and PARTWAY in error
    spec = tmp_path / "spec.toml"
    spec.write_text(
        '[model]\nd_model = 32\nn_layers = 2\nn_heads = 4\nnorm = { name = "early_norm" }\n'
    )
    for argv in (["validate", str(spec)], ["info", str(spec)]):
        code, _, err = run(capsys, *argv)
        assert code == 2, argv
        assert "model.norm.name: unknown norm 'early_norm'" in err and PARTWAY in err, argv
    code, _, err = run(capsys, "schema", "-o", str(tmp_path / "schema.json"))
    assert code == 0 and "plugin 'partway' (llmkit-partway) failed" in err


def test_bench_kernels_names_a_failed_plugin_for_an_unknown_kind(capsys, partway_failed):
    code, _, err = run(capsys, "bench", "kernels", "--kind", "metric", "--quick")
    assert code == 2 and "unknown kind 'metric'" in err
    assert "plugin 'partway' (llmkit-partway) provides it but failed to load" in err
