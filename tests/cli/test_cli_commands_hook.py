"""The ``register_commands`` hook: plugins add commands (and subcommands of llmkit's groups)
that run and show in ``--help``; a plugin whose commands clash or fail is reported and every
other command still works. Fake plugins are registered inline, pm-style."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from llmkit import hookimpl
from llmkit.cli import main
from llmkit.cli.commands import BUILTIN_COMMANDS, load_commands
from llmkit.errors import LlmkitError
from llmkit.registry import reset_registry
from tests.conftest import ROOT
from tests.helpers import registry_with


class Hello:
    """A plugin adding ``llmkit hello`` and ``llmkit bench hello``."""

    distribution, name = "llmkit-hello", "hello"

    @hookimpl
    def register_commands(self, register):
        register("hello", self.run, help="say hello", configure=self.configure, aliases=["hi"])
        register("hello", self.run_bench, group="bench", help="time a hello")

    @staticmethod
    def configure(parser):
        parser.add_argument("--name", default="world")

    @staticmethod
    def run(args):
        if args.name == "nobody":
            raise LlmkitError("nobody to greet")
        print(f"hello, {args.name}")

    @staticmethod
    def run_bench(args):
        print("hello took no time")
        return 3


class Clash:
    """Registers a command llmkit already has, after one of its own."""

    distribution, name = "llmkit-clash", "clash"

    @hookimpl
    def register_commands(self, register):
        register("mine", lambda args: print("mine ran"), help="a command of its own")
        register("list", lambda args: print("not llmkit's list"), help="a clash")


class Raises:
    distribution, name = "llmkit-raises", "raises"

    @hookimpl
    def register_commands(self, register):
        raise RuntimeError("boom")


class BadConfigure:
    distribution, name = "llmkit-badconf", "badconf"

    @hookimpl
    def register_commands(self, register):
        register("oops", lambda args: 0, help="never added", configure=lambda p: 1 / 0)


class NoGroup:
    distribution, name = "llmkit-nogroup", "nogroup"

    @hookimpl
    def register_commands(self, register):
        register("x", lambda args: 0, group="nope", help="under a group nobody registered")


@pytest.fixture
def installed():
    """Make a registry of the built-in plugin and the given fake plugins the process one."""

    def install(*plugins):
        reg = registry_with(*plugins)
        reset_registry(reg)
        return reg

    yield install
    reset_registry()


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def help_text(capsys, *argv):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_builtin_commands_come_through_the_hook(installed):
    table = load_commands(installed())
    keys = [c.key for c in table.commands]
    assert keys[:3] == ["list", "show", "plugins"]
    assert {"info", "train", "eval", "generate", "plugin new", "bench kernels"} <= set(keys)
    assert {c.plugin for c in table.commands} == {BUILTIN_COMMANDS}
    assert {c.provider for c in table.commands} == {"llmkit"}


def test_a_plugin_command_runs_and_shows_in_help(installed, capsys):
    reg = installed(Hello())
    assert not reg.failures()
    assert run(capsys, "hello", "--name", "you") == (0, "hello, you\n", "")
    assert run(capsys, "hi")[1] == "hello, world\n"  # the alias
    code, _, err = run(capsys, "hello", "--name", "nobody")
    assert code == 2 and err == "error: nobody to greet\n"
    out = help_text(capsys)
    assert "hello (hi)" in out and "say hello" in out and "list" in out
    assert run(capsys, "bench", "hello") == (3, "hello took no time\n", "")
    assert "time a hello" in help_text(capsys, "bench")
    code, out, _ = run(capsys, "plugins", "--json")
    (hello,) = [p for p in json.loads(out)["plugins"] if p["name"] == "hello"]
    assert hello["commands"] == ["hello", "bench hello"] and hello["status"] == "ok"
    assert "command 2" in run(capsys, "plugins")[1]


def test_a_duplicate_command_is_reported_and_the_builtin_keeps_its_name(installed, capsys):
    reg = installed(Clash())
    load_commands(reg)  # what main() does first
    (failed,) = reg.failures()
    assert failed.name == "clash"
    assert "command 'llmkit list' already exists (from llmkit" in failed.error
    code, out, err = run(capsys, "list", "attention")
    assert code == 0 and "sdpa" in out and "not llmkit's list" not in out
    assert "plugin 'clash' (llmkit-clash) failed: register_commands: RegistryError" in err
    assert run(capsys, "mine")[1] == "mine ran\n"  # registered before the clash: kept
    assert "plugins that failed: 'clash' (llmkit-clash)" in help_text(capsys)


def test_the_first_of_two_plugins_keeps_a_contested_name(installed, capsys):
    class Again(Hello):
        distribution, name = "llmkit-again", "again"

    reg = installed(Hello(), Again())
    load_commands(reg)
    assert [(f.name, "already exists (from llmkit-hello" in f.error) for f in reg.failures()] == [
        ("again", True)
    ]
    assert run(capsys, "hello")[1] == "hello, world\n"


@pytest.mark.parametrize(
    ("plugin", "error"),
    [
        (Raises(), "register_commands: RuntimeError: boom"),
        (BadConfigure(), "register_commands: ZeroDivisionError"),
        (NoGroup(), "no command group 'nope' registered before it"),
    ],
    ids=["hook-raises", "configure-raises", "unknown-group"],
)
def test_a_plugin_whose_commands_fail_is_reported_and_others_work(installed, capsys, plugin, error):
    reg = installed(plugin, Hello())
    load_commands(reg)
    (failed,) = reg.failures()
    assert failed.name == plugin.name and error in failed.error
    assert run(capsys, "hello")[1] == "hello, world\n"
    code, out, err = run(capsys, "list", "ffn")
    assert code == 0 and "mlp" in out and f"plugin '{plugin.name}'" in err
    out = help_text(capsys)
    assert "hello" in out and "oops" not in out
    assert f"plugins that failed: '{plugin.name}'" in out


def test_strict_mode_makes_a_failing_command_plugin_an_error(installed, capsys, monkeypatch):
    monkeypatch.setenv("LLMKIT_STRICT_PLUGINS", "1")
    installed(Raises())  # components load; the commands hook is only called by the CLI
    code, _, err = run(capsys, "list")
    assert code == 2 and "plugin 'raises' (llmkit-raises) failed: register_commands" in err
    assert "Traceback" not in err
    assert "validate" in help_text(capsys)  # help still works, from the built-in commands


def test_commands_load_without_importing_heavy_modules(installed):
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = (
        "import sys\nfrom llmkit.registry import get_registry\n"
        "from llmkit.cli.commands import load_commands\n"
        "assert len(load_commands(get_registry()).commands) > 10\n"
        "heavy = [m for m in ('torch', 'triton', 'datasets', 'rich') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


# -- the commands the plugin docs show ------------------------------------------------------------

DOCS = ROOT / "docs" / "plugins"


def _doc_commands(text: str) -> list[list[str]]:
    """The ``llmkit ...`` command lines of a page's ``bash`` blocks, as argv (comments and
    leading ``VAR=value`` assignments dropped)."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```$", text, re.M | re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0] and not words[0].startswith("-"):
                words.pop(0)
            if words[:1] == ["llmkit"]:
                out.append(words[1:])
    return out


class TutorialProbe:
    """Stands in for the tutorial's ``llmkit probe SPEC`` (its plugin is not installed here)."""

    distribution, name = "llmkit-probes", "probes"

    @hookimpl
    def register_commands(self, register):
        register("probe", lambda args: 0, help="the tutorial's command", configure=self.configure)

    @staticmethod
    def configure(parser):
        parser.add_argument("spec")


def test_the_plugin_docs_show_only_commands_that_exist(installed, capsys):
    """Every ``llmkit`` line of docs/plugins/*.md parses with the real command line."""
    from llmkit.cli.app import build_parser

    parser = build_parser(load_commands(installed(TutorialProbe())).commands)
    shown = {
        page.name: _doc_commands(page.read_text(encoding="utf-8")) for page in DOCS.glob("*.md")
    }
    assert len(shown["tutorial.md"]) >= 10  # the blocks were found
    for page, argvs in shown.items():
        for argv in argvs:
            try:
                parser.parse_args(argv)
            except SystemExit as exc:  # --help and --version exit 0; a bad command exits 2
                assert exc.code == 0, (page, argv, capsys.readouterr().err)
    capsys.readouterr()


def test_the_tutorial_sets_up_a_separate_environment():
    """The tutorial installs llmkit and the plugin into an environment of their own (from
    the checkout or a wheel), and the plugin editable beside a non-editable llmkit, then shows
    how to check that llmkit sees it."""
    text = (DOCS / "tutorial.md").read_text(encoding="utf-8")
    start = text.index("## Set up an environment\n")
    section = text[start : text.index("\n## ", start + 1)]
    lines = [
        line.split("#")[0].strip()
        for block in re.findall(r"^```bash\n(.*?)^```$", section, re.M | re.S)
        for line in block.splitlines()
    ]
    for expected in (
        r"python3\.11 -m venv \S+",
        r"pip install -e /path/to/llmkit",  # editable, from the checkout
        r"pip install /path/to/dist/llmkit-[\d.]+-py3-none-any\.whl",  # a wheel, not editable
        r"pip install -e \./llmkit-softcap",  # the plugin, editable beside it
        r"llmkit plugin new llmkit-softcap --kind attention",
        r"llmkit plugins",
        r"llmkit list attention softcap",
    ):
        assert any(re.fullmatch(expected, line) for line in lines), (expected, lines)
    assert "pip wheel --no-deps -w dist /path/to/llmkit" in section
    assert [argv[0] for argv in _doc_commands(section)] == [
        "--version",
        "plugin",
        "plugins",
        "list",
        "show",
        "list",
    ]
