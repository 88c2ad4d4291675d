"""The plugin packages in plugins/: installed, conformant, visible in every command, isolated
when broken, settled when they clash, and required by specs — each proved end to end with the
plugins switched on through $LLMKIT_PLUGINS (tests/conftest.py switches them off). The broken
fixture is never installed in the environment: the tests that need it install it throwaway
(``broken_fixture_site``)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from llmkit.cli import main
from llmkit.registry import Registry, get_registry, reset_registry
from llmkit.testing import check_component, conformance_params
from tests.conftest import BROKEN_FIXTURE, ROOT, SPECS

PLUGINS = ROOT / "plugins"
PACKAGES = sorted(p.parent for p in PLUGINS.glob("*/pyproject.toml"))
WORKING = {"extras": "llmkit-extras", "losses": "llmkit-losses"}  # entry point → distribution
EXTRAS_SPEC = PLUGINS / "llmkit-extras" / "specs" / "tiny-extras.toml"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def plugins_on(monkeypatch):
    """Switch installed plugins on (``plugins_on("extras", ...)``; no names = all installed),
    with a process registry rebuilt from scratch and dropped afterwards."""

    def switch(*names: str) -> Registry:
        if names:
            monkeypatch.setenv("LLMKIT_PLUGINS", ",".join(names))
        else:
            monkeypatch.delenv("LLMKIT_PLUGINS", raising=False)
        reset_registry()
        return get_registry()

    yield switch
    reset_registry()


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _env(site: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a subprocess: ``extra`` set, the other LLMKIT_* switches unset (so
    LLMKIT_PLUGINS unset = every installed plugin loads); ``site`` (a throwaway install, e.g.
    of the broken fixture) goes on its PYTHONPATH."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    for key in ("LLMKIT_PLUGINS", "LLMKIT_STRICT_PLUGINS", "LLMKIT_REGISTRY"):
        if key not in extra:
            env.pop(key, None)
    return env


# -- the packages ---------------------------------------------------------------------------------


def test_every_plugin_package_is_complete_and_installed():
    assert {p.name for p in PACKAGES} >= {"llmkit-extras", "llmkit-losses", "llmkit-broken-fixture"}
    for pkg in PACKAGES:
        meta = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
        eps = meta["entry-points"]["llmkit"]
        assert eps, f"{pkg.name}: no [project.entry-points.llmkit]"
        assert (pkg / "README.md").is_file() and list((pkg / "tests").glob("test_*.py")), pkg
        if pkg == BROKEN_FIXTURE:
            continue
        dist = md.distribution(meta["name"])  # installed by the set-up (make setup)
        assert dist.version == meta["version"]
        installed = {e.name: e.value for e in dist.entry_points if e.group == "llmkit"}
        assert installed == eps, f"{pkg.name}: reinstall it (pip install -e {pkg})"


def test_the_broken_fixture_stays_out_of_the_users_environment():
    """Installed, it would make every command the user runs warn about it."""
    with pytest.raises(md.PackageNotFoundError):
        md.distribution("llmkit-broken-fixture")
    assert "broken_fixture" not in {e.name for e in md.entry_points(group="llmkit")}


def test_make_test_installs_no_fixture_and_removes_an_old_one():
    proc = subprocess.run(
        ["make", "-n", "-B", "test", "VENV=/nonexistent-venv"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    installs = [line for line in lines if "pip install" in line]
    assert installs and not any("broken-fixture" in line for line in installs), installs
    assert any("uninstall" in line and "llmkit-broken-fixture" in line for line in lines)


def test_each_plugin_package_passes_its_own_tests():
    """CI runs `pytest tests`; this runs every plugins/*/tests suite too."""
    targets = [str(p / "tests") for p in PACKAGES]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# -- conformance and the commands ----------------------------------------------------------------


def _plugin_params():
    reg = Registry()
    reg.load_entry_points(list(WORKING))
    return [p for p in conformance_params(registry=reg) if p.values[0].provider != "llmkit"]


@pytest.mark.parametrize("record", _plugin_params())
def test_installed_plugin_components_pass_the_conformance_suite(record):
    check_component(record)


def test_plugin_components_appear_in_list_show_and_schema(plugins_on, capsys, tmp_path):
    reg = plugins_on(*WORKING)
    assert not reg.failures()
    code, out, _ = cli(capsys, "list")
    assert code == 0
    for name in ("qk_norm", "dyt", "scalenorm", "ademamix", "rex", "z_loss", "label_smoothing"):
        assert name in out
    assert "llmkit-extras" in out and "llmkit-losses" in out
    code, out, _ = cli(capsys, "list", "loss")
    assert code == 0 and "cross_entropy" in out
    code, out, _ = cli(capsys, "show", "qk_transform", "qk_norm")
    assert code == 0 and "llmkit-extras 0.1.0" in out
    schema_file = tmp_path / "schema.json"
    assert main(["schema", "-o", str(schema_file)]) == 0
    defs = json.loads(schema_file.read_text())["$defs"]
    for key in ("qk_transform__qk_norm", "norm__dyt", "norm__scalenorm", "optimizer__ademamix"):
        assert key in defs and defs[key]["additionalProperties"] is False
    assert "schedule__rex" in defs


def test_example_specs_validate_with_every_plugin_installed(
    broken_fixture_site, plugins_on, capsys
):
    plugins_on()  # everything installed, the broken fixture included
    specs = sorted(SPECS.glob("*.toml")) + sorted(SPECS.glob("*.yaml")) + [EXTRAS_SPEC]
    code, out, err = cli(capsys, "validate", *map(str, specs))
    assert code == 0, err
    assert "broken_fixture" in err
    assert out.count("✓") == len(specs)  # the broken fixture loaded too, and broke nothing


def test_benchmark_suite_picks_up_plugin_components():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--benchmark-disable",
            "-k",
            "dyt or scalenorm",
            "-v",
            "benchmarks/components/test_components.py",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(LLMKIT_PLUGINS="extras"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    for name in ("dyt", "scalenorm"):  # e.g. test_ffn_and_norm_forward_backward[dyt]
        assert any(f"[{name}" in line and "PASSED" in line for line in lines), name


def test_a_spec_made_of_plugin_components_trains(plugins_on, tmp_path):
    from llmkit.training import train

    plugins_on("extras")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 200)
    spec = tmp_path / "spec.toml"
    spec.write_text(
        textwrap.dedent(
            f"""
            requires = ["llmkit-extras>=0.1"]
            [model]
            vocab_size = 64
            d_model = 32
            n_layers = 2
            n_heads = 4
            n_kv_heads = 2
            max_seq_len = 32
            qk_transform = {{ name = "qk_norm", gain = "vector" }}
            norm = {{ name = "dyt" }}
            position = {{ name = "rope" }}
            [[model.overrides]]
            layers = [1]
            norm = {{ name = "scalenorm" }}
            [tokenizer]
            kind = "char"
            [data]
            source = {{ name = "text", paths = ["{corpus}"], val_fraction = 0.1 }}
            [optimizer]
            name = "ademamix"
            lr = 3e-3
            alpha_beta3_warmup = 6
            [schedule]
            name = "rex"
            warmup_steps = 2
            [train]
            batch_size = 4
            max_steps = 6
            eval_interval = 6
            eval_batches = 1
            log_interval = 1
            precision = "fp32"
            device = "cpu"
            sample_tokens = 0
            """
        )
    )
    result = train(spec, run_dir=tmp_path / "run", log=lambda _m: None, progress=False)
    assert result.step == 6 and result.val_loss is not None
    resolved = json.loads((tmp_path / "run" / "resolved.json").read_text())
    assert resolved["optimizer"]["name"] == "ademamix"


def test_listing_stays_import_light_with_every_plugin_loaded(broken_fixture_site):
    code = (
        "import sys\nfrom llmkit.cli import main\n"
        "assert main(['list']) == 0 and main(['plugins']) == 1\n"
        "heavy = [m for m in ('torch', 'triton', 'datasets') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(broken_fixture_site),  # LLMKIT_PLUGINS unset: every installed plugin
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


# -- a broken plugin -------------------------------------------------------------------------------

BROKEN = "RuntimeError: llmkit-broken-fixture is a test fixture that always fails to import"


@pytest.mark.parametrize("enabled", [("broken_fixture",), ()], ids=["allowed", "all-installed"])
def test_a_broken_plugin_breaks_no_command_and_is_named(
    broken_fixture_site, plugins_on, capsys, enabled
):
    reg = plugins_on(*enabled)
    assert [f.name for f in reg.failures()] == ["broken_fixture"]
    code, out, err = cli(capsys, "list")
    assert code == 0 and "sdpa" in out
    assert f"plugin 'broken_fixture' (llmkit-broken-fixture) failed: {BROKEN}" in err
    code, out, err = cli(capsys, "validate", str(SPECS / "tiny.toml"))
    assert code == 0 and "✓" in out
    assert BROKEN in err
    code, out, _ = cli(capsys, "plugins")
    assert code == 1  # a health check: something failed
    assert "FAILED" in out and "failed to load" in out
    assert f"broken_fixture (llmkit-broken-fixture 0.1.0): {BROKEN}" in out
    code, out, _ = cli(capsys, "plugins", "--json")
    report = json.loads(out)
    (broken,) = [p for p in report["plugins"] if p["name"] == "broken_fixture"]
    assert broken["status"] == "failed" and broken["error"].startswith(BROKEN)
    if not enabled:
        assert {p["name"] for p in report["plugins"]} >= {"builtin", "extras", "losses"}


@pytest.mark.parametrize(
    "argv",
    [
        ["show", "attention", "sdpa"],
        ["info", str(SPECS / "tiny.toml")],
        ["eval", "no-such-run"],
        ["generate", "no-such-run", "--prompt", "x"],
        ["train", "no-such-spec.toml"],
        ["schema"],
    ],
    ids=lambda argv: argv[0],
)
def test_every_command_names_a_broken_plugin_once(broken_fixture_site, plugins_on, capsys, argv):
    """Whether the command succeeds or fails, one warning line per failed plugin, first."""
    plugins_on("broken_fixture")
    _, _, err = cli(capsys, *argv)
    warning = f"plugin 'broken_fixture' (llmkit-broken-fixture) failed: {BROKEN}"
    assert err.count(warning) == 1, err
    assert err.startswith("warning: " + warning)


@pytest.mark.parametrize(
    "argv", [["list"], ["validate", str(SPECS / "tiny.toml")], ["plugins"]], ids=lambda a: a[0]
)
def test_strict_mode_makes_a_broken_plugin_an_error(broken_fixture_site, argv):
    proc = subprocess.run(
        [sys.executable, "-m", "llmkit.cli", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(broken_fixture_site, LLMKIT_PLUGINS="broken_fixture", LLMKIT_STRICT_PLUGINS="1"),
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "plugin 'broken_fixture' (llmkit-broken-fixture) failed" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_plugins_reports_plugins_left_out_by_the_allow_list(
    broken_fixture_site, plugins_on, capsys
):
    plugins_on("extras")
    code, out, _ = cli(capsys, "plugins", "--json")
    report = json.loads(out)
    assert code == 0 and report["allow_list"] == ["extras"]
    names = {p["name"] for p in report["not_loaded"]}
    assert {"losses", "broken_fixture"} <= names and "extras" not in names
    (extras,) = [p for p in report["plugins"] if p["name"] == "extras"]
    assert extras["registered"] == [
        "norm.dyt",
        "norm.scalenorm",
        "optimizer.ademamix",
        "qk_transform.qk_norm",
        "schedule.rex",
    ]
    code, out, _ = cli(capsys, "plugins")
    assert "off: installed but not loaded, as LLMKIT_PLUGINS='extras'" in out


# -- two installed plugins with the same name ---------------------------------------------------


def install_fake(site: Path, dist: str, entry_point: str, source: str) -> None:
    """Install a one-module plugin distribution into ``site`` the way pip leaves it: the
    module and a dist-info with METADATA and entry_points.txt (found on sys.path)."""
    module = dist.replace("-", "_")
    site.mkdir(exist_ok=True)
    (site / f"{module}.py").write_text(
        "from llmkit import hookimpl\n\n" + textwrap.dedent(source), encoding="utf-8"
    )
    info = site / f"{module}-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3.0\n")
    (info / "entry_points.txt").write_text(f"[llmkit]\n{entry_point} = {module}\n")


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A site directory on sys.path for :func:`install_fake`; its modules are forgotten after."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    before = set(sys.modules)
    yield site
    for name in set(sys.modules) - before:
        if name.startswith("llmkit_fake") or name == "llmkit_clash":
            sys.modules.pop(name, None)


@pytest.fixture
def clash_installed(fake_site):
    """An installed distribution `llmkit-clash` whose plugin also registers norm.dyt, which
    llmkit-extras provides."""
    install_fake(
        fake_site,
        "llmkit-clash",
        "clash",
        """
        @hookimpl
        def register_components(register):
            register("norm", "dyt", "llmkit.components.norm.rmsnorm:RMSNorm",
                     summary="RMSNorm under the name dyt")
        """,
    )
    return fake_site.parent


def _dyt_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "dyt.toml"
    spec.write_text(
        '[model]\nd_model = 32\nn_layers = 2\nn_heads = 4\nnorm = { name = "dyt" }\n'
        '[data]\nsource = { name = "text", paths = ["x.txt"] }\n'
    )
    return spec


def test_a_clash_names_both_providers_everywhere(clash_installed, plugins_on, capsys):
    reg = plugins_on("extras", "clash")
    assert reg.plugins["clash"].distribution == "llmkit-clash"
    code, out, _ = cli(capsys, "list", "norm")
    assert code == 0 and "CONFLICT" in out
    assert "llmkit-clash & llmkit-extras" in out or "llmkit-extras & llmkit-clash" in out
    code, _, err = cli(capsys, "validate", str(_dyt_spec(clash_installed)))
    assert code == 2
    assert "model.norm.name: norm.dyt is registered by more than one plugin" in err
    assert "llmkit-clash" in err and "llmkit-extras" in err and "choose one in" in err
    assert "[winners]" in err
    code, _, err = cli(capsys, "show", "norm", "dyt")
    assert code == 2 and "llmkit-clash" in err and "llmkit-extras" in err
    code, out, _ = cli(capsys, "plugins", "-v")
    assert code == 1 and "conflicts" in out
    assert "norm.dyt: conflict between" in out
    assert "norm.dyt (unusable: conflict)" in out
    code, out, _ = cli(capsys, "list", "norm", "scalenorm")  # the rest of extras is unaffected
    assert code == 0 and "llmkit-extras" in out


@pytest.mark.parametrize("winner", ["llmkit-extras", "llmkit-clash"])
def test_a_registry_file_chooses_the_winner(
    clash_installed, plugins_on, capsys, monkeypatch, winner
):
    choice = clash_installed / "mine.toml"
    choice.write_text(f'[winners]\n"norm.dyt" = "{winner}"\n')
    monkeypatch.setenv("LLMKIT_REGISTRY", str(choice))
    reg = plugins_on("extras", "clash")
    assert reg.get("norm", "dyt").provider == winner
    loser = "llmkit-clash" if winner == "llmkit-extras" else "llmkit-extras"
    code, out, _ = cli(capsys, "validate", str(_dyt_spec(clash_installed)))
    assert code == 0, out
    code, out, _ = cli(capsys, "show", "norm", "dyt")
    assert code == 0 and f"provider: {winner}" in out
    code, out, _ = cli(capsys, "plugins", "-v")
    assert code == 0
    assert f"norm.dyt: {winner} wins over {loser}" in out
    assert str(choice) in out
    loser_plugin = "clash" if loser == "llmkit-clash" else "extras"
    assert f"{loser_plugin}: " in out and f"norm.dyt (overridden by {winner})" in out
    report = json.loads(cli(capsys, "plugins", "--json")[1])
    assert report["conflicts"] == [
        {"key": "norm.dyt", "providers": report["conflicts"][0]["providers"], "winner": winner}
    ]
    (lost,) = [p for p in report["plugins"] if p["distribution"] == loser]
    assert lost["overridden"] == ["norm.dyt"]


# -- specs that require plugins ---------------------------------------------------------------


def _requiring(tmp_path: Path, requirement: str, ffn: str = "mlp") -> Path:
    spec = tmp_path / "needs.toml"
    spec.write_text(
        f'requires = ["{requirement}"]\n'
        f'[model]\nd_model = 32\nn_layers = 2\nn_heads = 4\nnorm = {{ name = "dyt" }}\n'
        f'ffn = {{ name = "{ffn}" }}\n'
    )
    return spec


def test_requires_is_satisfied_by_the_installed_plugin(plugins_on, capsys, tmp_path):
    plugins_on("extras")
    code, _, err = cli(capsys, "validate", str(_requiring(tmp_path, "llmkit-extras>=0.1")))
    assert code == 0, err
    code, _, err = cli(capsys, "validate", str(EXTRAS_SPEC))
    assert code == 0, err


@pytest.mark.parametrize(
    ("requirement", "message"),
    [
        ("llmkit-extras>=99", "requires: llmkit-extras>=99 but llmkit-extras 0.1.0 is installed"),
        (
            "llmkit-no-such-plugin>=0.2",
            "requires: llmkit-no-such-plugin>=0.2 is not installed "
            "(pip install 'llmkit-no-such-plugin>=0.2')",
        ),
    ],
    ids=["too-old", "missing"],
)
def test_requires_fails_first_naming_the_distribution(
    plugins_on, capsys, tmp_path, requirement, message
):
    plugins_on("extras")
    spec = _requiring(tmp_path, requirement, ffn="swiglo")  # also invalid: not reported
    code, _, err = cli(capsys, "validate", str(spec))
    assert code == 2
    assert message in err
    assert "swiglo" not in err  # checked before anything else is validated


def test_a_plugin_name_nothing_provides_is_reported(plugins_on, capsys):
    reg = plugins_on("extra", "losses")  # a typo for "extras"
    (bad,) = reg.failures()
    assert bad.name == "extra" and "no installed package provides it" in bad.error
    assert "extras" in bad.error  # the installed names, to spot the typo
    assert "losses" in reg.plugins and reg.plugins["losses"].error is None
    code, out, _ = cli(capsys, "plugins")
    assert code == 1 and "extra (not installed): named in LLMKIT_PLUGINS" in out


def test_requires_names_an_installed_plugin_that_is_switched_off(plugins_on, capsys, tmp_path):
    plugins_on("losses")  # llmkit-extras is installed, but its plugin is not loaded
    code, _, err = cli(capsys, "validate", str(_requiring(tmp_path, "llmkit-extras>=0.1")))
    assert code == 2
    assert (
        "requires: llmkit-extras is installed but its plugin extras is not loaded: "
        "LLMKIT_PLUGINS='losses' leaves it out"
    ) in err
    assert "unknown norm 'dyt'" not in err  # checked before the components


# -- loading order ----------------------------------------------------------------------------


def test_plugin_names_sorting_before_builtin_can_use_builtin_kinds(fake_site, plugins_on):
    install_fake(
        fake_site,
        "llmkit-fake-aaa",
        "aaa",  # sorts before "builtin"
        """
        @hookimpl
        def register_components(register):
            register("norm", "aaa_norm", "llmkit.components.norm.rmsnorm:RMSNorm")
        """,
    )
    reg = plugins_on("aaa")
    assert not reg.failures()
    assert reg.get("norm", "aaa_norm").provider == "llmkit-fake-aaa"
    assert next(iter(reg.plugins)) == "builtin"


def test_a_plugin_can_use_a_kind_declared_by_a_plugin_loaded_after_it(fake_site, plugins_on):
    install_fake(
        fake_site,
        "llmkit-fake-metrics",
        "metrics_user",  # sorts before "zz_kinds", which declares the kind it uses
        """
        @hookimpl
        def register_components(register):
            register("metric", "accuracy", "builtins:len",
                     options="llmkit.contracts:NoOptions")
        """,
    )
    install_fake(
        fake_site,
        "llmkit-fake-kinds",
        "zz_kinds",
        """
        @hookimpl
        def register_kinds(register):
            register("metric", "Evaluation metrics")
        """,
    )
    reg = plugins_on("metrics_user", "zz_kinds")
    assert not reg.failures(), [f.error for f in reg.failures()]
    assert reg.kinds["metric"].provider == "llmkit-fake-kinds"
    assert reg.get("metric", "accuracy").provider == "llmkit-fake-metrics"
    check_component(reg.get("metric", "accuracy"))  # the generic check for unknown kinds


def test_a_third_party_plugin_named_builtin_is_refused_without_hiding_llmkits(
    fake_site, plugins_on
):
    install_fake(
        fake_site,
        "llmkit-fake-impostor",
        "builtin",
        """
        @hookimpl
        def register_components(register):
            register("ffn", "mlp", "builtins:len")
        """,
    )
    reg = plugins_on()
    (failed,) = [f for f in reg.failures() if f.distribution == "llmkit-fake-impostor"]
    assert failed.error == "reserved plugin name 'builtin'"
    assert reg.plugins["builtin"].distribution == "llmkit"
    assert reg.get("ffn", "mlp").provider == "llmkit"


def test_plugin_docs_exist_and_their_links_resolve():
    docs = ROOT / "docs" / "plugins"
    pages = {p.name for p in docs.glob("*.md")}
    assert {"tutorial.md", "hooks.md", "contracts.md", "troubleshooting.md"} <= pages
    import re

    for page in [*docs.glob("*.md"), *PLUGINS.glob("*/README.md"), PLUGINS / "README.md"]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}"


def test_a_plugins_failure_is_kept_as_one_line():
    from llmkit import hookimpl
    from tests.helpers import registry_with

    class Noisy:
        distribution = "llmkit-noisy"
        name = "noisy"

        @hookimpl
        def register_components(self, register):
            raise RuntimeError("boom while registering\nsecond line\nthird")

    reg = registry_with(Noisy())
    (failed,) = reg.failures()
    assert failed.error.endswith("RuntimeError: boom while registering")
    assert "\n" not in failed.error
