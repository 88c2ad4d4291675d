"""docs/plugins/tutorial.md works as written: its files, extracted from the page, make two
plugin packages that install and add (a) an attention component, (b) a new kind with its own
spec section and (c) a command.

Fenced blocks whose info string has ``file=PATH`` are files (``append`` adds to the file);
``llmkit-softcap`` starts from ``llmkit plugin new``, as the tutorial says. Both packages are
installed with pip into a throwaway directory put on ``sys.path``: llmkit finds them through
their dist-info, as it would in a virtual environment.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmkit import hookimpl
from llmkit.cli import main
from llmkit.errors import LlmkitError
from llmkit.registry import Registry, get_registry, reset_registry
from llmkit.spec import load_spec
from tests.conftest import ROOT

TUTORIAL = ROOT / "docs" / "plugins" / "tutorial.md"
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
BLOCK = re.compile(r"^```(\w+) file=(\S+)( append)?\n(.*?)^```$", re.M | re.S)
PLUGINS = "softcap,probes"


def tutorial_files() -> dict[str, str]:
    """Relative path → text of every file the tutorial shows."""
    files: dict[str, str] = {}
    for match in BLOCK.finditer(TUTORIAL.read_text(encoding="utf-8")):
        _, path, append, text = match.groups()
        files[path] = f"{files[path]}\n\n{text}" if append else text
    return files


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    full.pop("LLMKIT_STRICT_PLUGINS", None)
    full.pop("LLMKIT_REGISTRY", None)
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=full, timeout=300)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tutorial carried out in a directory: llmkit-softcap generated then edited,
    llmkit-probes written, both installed into ``site/``, llmkit-my-probe generated."""
    work = tmp_path_factory.mktemp("tutorial")
    cli = [sys.executable, "-m", "llmkit.cli", "plugin", "new"]
    proc = _run([*cli, "llmkit-softcap", "--kind", "attention"], work, LLMKIT_PLUGINS="")
    assert proc.returncode == 0, proc.stderr
    shown = re.search(r"^```\n(created llmkit-softcap.*?)^```$", TUTORIAL.read_text(), re.M | re.S)
    assert shown is not None and proc.stdout.startswith(shown.group(1))
    for rel, text in tutorial_files().items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text, encoding="utf-8")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install"]
    pip += ["--no-deps", "--no-build-isolation", "--no-index", "--target", str(work / "site")]
    proc = _run([*pip, "./llmkit-softcap", "./llmkit-probes"], work)
    assert proc.returncode == 0, proc.stderr
    site = str(work / "site")
    proc = _run(
        [*cli, "llmkit-my-probe", "--kind", "probe"], work, PYTHONPATH=site, LLMKIT_PLUGINS="probes"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return work


@pytest.fixture
def installed(work: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    """The process registry with both tutorial plugins loaded from ``site/``."""
    monkeypatch.syspath_prepend(str(work / "site"))
    monkeypatch.setenv("LLMKIT_PLUGINS", PLUGINS)
    reset_registry()
    try:
        yield get_registry()
    finally:
        reset_registry()
        for name in [m for m in sys.modules if m.startswith(("llmkit_softcap", "llmkit_probes"))]:
            del sys.modules[name]
        importlib.invalidate_caches()


def test_the_tutorial_shows_whole_files_that_use_only_the_public_api(work):
    import llmkit
    import llmkit.testing

    files = tutorial_files()
    assert {p.split("/")[0] for p in files} == {"llmkit-softcap", "llmkit-probes", "probe.toml"}
    public = {"llmkit": set(llmkit.__all__), "llmkit.testing": set(llmkit.testing.__all__)}
    for rel in files:
        if not rel.endswith(".py"):
            continue
        for node in ast.walk(ast.parse((work / rel).read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmkit."):
                assert node.module == "llmkit.testing", (rel, node.module)
            if isinstance(node, ast.ImportFrom) and node.module in public:
                names = {a.name for a in node.names}
                assert names <= public[node.module], (rel, names - public[node.module])
    if RUFF:
        root_config = ["--config", str(ROOT / "pyproject.toml")]
        for where, config in [("llmkit-softcap", []), ("llmkit-probes", root_config)]:
            for args in (["check", "-q"], ["format", "--check", "-q"]):
                proc = _run([RUFF, *args, *config, "."], work / where)
                assert proc.returncode == 0, (where, proc.stdout, proc.stderr)


def test_a_an_attention_component(work, installed, capsys):
    from llmkit.testing import check_component

    record = installed.get("attention", "softcap")
    assert (record.provider, record.capabilities["approximate"]) == ("llmkit-softcap", True)
    check_component(record)
    spec = str(work / "llmkit-softcap" / "specs" / "tiny-softcap.toml")
    assert main(["validate", spec]) == 0
    assert main(["info", spec]) == 0 and "softcap" in capsys.readouterr().out
    with pytest.raises(LlmkitError, match=r"model\.attention\.capp: unknown option for attention "):
        load_spec(spec, ["model.attention.capp=30"])
    # It trains: a small version of the spec fits a fixed batch.
    import torch

    from llmkit import build_model

    small = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=4"]
    # (a char tokenizer: a byte-level BPE needs at least 257 ids)
    resolved = load_spec(spec, [*small, "model.max_seq_len=16", "tokenizer.kind=char"])
    assert resolved.layers[0].attention.options.cap == 30.0
    torch.manual_seed(0)
    model = build_model(resolved)
    assert "SoftcapAttention" in {type(m).__name__ for m in model.modules()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(64, (4, 16))
    losses = []
    for _ in range(4):
        loss = model(idx[:, :-1], idx[:, 1:]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_b_a_kind_with_its_own_spec_section(work, installed, capsys):
    from llmkit.testing import check_component

    kind = installed.kinds["probe"]
    assert (kind.section, kind.default, kind.provider) == ("probe", None, "llmkit-probes")
    probe_spec, plain_spec = work / "probe.toml", work / "llmkit-softcap/specs/tiny-softcap.toml"
    # The spec's [probe] table: resolved, validated with its full path, optional.
    resolved = load_spec(probe_spec)
    chosen = resolved.component("probe")
    assert chosen.name == "logit_stats" and chosen.options.temperature == 1.0
    assert resolved.to_dict()["probe"] == {"name": "logit_stats", "temperature": 1.0}
    assert load_spec(plain_spec).component("probe") is None
    with pytest.raises(LlmkitError, match=r"probe\.temprature: unknown option for probe "):
        load_spec(probe_spec, ["probe.temprature=2"])
    with pytest.raises(LlmkitError, match="unknown probe 'logit_stat'"):
        load_spec(probe_spec, ["probe.name=logit_stat"])
    # Its schema branch.
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "logit_stats" in json.dumps(schema["properties"]["probe"]) + json.dumps(
        {k: v for k, v in schema.get("$defs", {}).items() if "probe" in k}
    )
    # Its conformance check: run for its components, and it catches a broken probe.
    check_component(installed.get("probe", "logit_stats"))

    class Eager:
        def __init__(self, options: object) -> None:
            pass

        def __call__(self, model, tokens):
            model.eval()
            return {"x": 1.0}

    class BadProbes:
        @hookimpl
        def register_components(self, register):
            register("probe", "eager", Eager)

    assert installed.add_plugin(BadProbes(), "bad", "llmkit-bad-probes", "0.0").error is None
    with pytest.raises(AssertionError, match=r"probe 'eager' .* left the model in eval mode"):
        check_component(installed.get("probe", "eager"))
    # Its template: `plugin new --kind probe` wrote llmkit-my-probe (its tests run below).
    generated = work / "llmkit-my-probe"
    assert (generated / "llmkit_my_probe" / "my_probe.py").is_file()
    assert '"llmkit-probes>=0.1.0"' in (generated / "pyproject.toml").read_text()


def test_c_a_command(work, installed, capsys):
    env = {"PYTHONPATH": str(work / "site"), "LLMKIT_PLUGINS": PLUGINS}
    proc = _run([sys.executable, "-m", "llmkit.cli", "--help"], work, **env)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^\s+probe\s+run the spec's \[probe\] on its freshly", proc.stdout, re.M)
    assert main(["probe", str(work / "probe.toml")]) == 0
    out = capsys.readouterr().out.splitlines()
    shown = re.search(r"^```\n(logit_stats on .*?)^```$", TUTORIAL.read_text(), re.M | re.S)
    expected = shown.group(1).splitlines()
    assert out[0] == expected[0] and [s.split()[0] for s in out[1:]] == [
        "entropy",
        "max_entropy",
        "top1",
    ]
    values = {line.split()[0]: float(line.split()[1]) for line in out[1:]}
    documented = {line.split()[0]: float(line.split()[1]) for line in expected[1:]}
    assert values["max_entropy"] == documented["max_entropy"] == round(math.log(4096), 4)
    assert values["entropy"] <= values["max_entropy"]
    assert values["entropy"] == pytest.approx(documented["entropy"], abs=0.02)
    assert main(["probe", str(work / "probe.toml"), "--set", "probe.temperature=0.5"]) == 0
    capsys.readouterr()
    assert main(["probe", str(work / "llmkit-softcap/specs/tiny-softcap.toml")]) == 2
    assert "has no [probe] table" in capsys.readouterr().err


def test_the_plugins_pass_their_own_tests(work):
    """llmkit-softcap's generated and hand-written tests, and those `plugin new --kind probe`
    generated, pass against the installed packages."""
    roots = [work / "llmkit-softcap", work / "llmkit-my-probe"]
    proc = _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
        + [str(r / "tests") for r in roots],
        work,
        PYTHONPATH=os.pathsep.join([str(work / "site"), str(work / "llmkit-my-probe")]),
        LLMKIT_PLUGINS="",
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # softcap: 7 generated (its options module's test included) + 2 of its own; my-probe: 4
    # (its kind's template has no options module; its entry point is not installed)
    assert "13 passed, 1 skipped" in proc.stdout, proc.stdout[-2000:]
