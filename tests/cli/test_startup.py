"""Start-up cost of the commands that read specs and the registry: what they import.

Each command runs in a fresh interpreter (``main(argv)``) and the test reads ``sys.modules``
afterwards, as tests/cli/test_cli_app.py does for ``--help`` and ``list``.

``validate``, ``show`` and ``schema`` need no model, and import no torch: the built-in
components keep their pydantic ``Options`` in one torch-free module per kind
(``llmkit.components.<kind>.options``, named by each ``registry.toml`` entry's ``options``),
whose bases are in the torch-free ``llmkit.options`` (re-exported by ``llmkit.contracts``, which
defines the ``nn.Module`` contracts), and the built-in schedules, which ``validate`` builds
to check a spec's warmup against its run, import none either. Only ``validate --build`` (the
model on the meta device) and ``show --runtime`` (the component's module) import torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, SPECS

HEAVY = ("torch", "triton", "datasets")


def heavy_after(argv: list[str], *, expect: int | None = None) -> list[str]:
    """The heavy libraries imported by ``llmkit ARGV`` in a fresh interpreter (only the
    built-in plugin loaded); ``expect``: the exit status the command must return."""
    code = (
        "import json, sys\nfrom llmkit.cli import main\n"
        f"try:\n    code = main({argv!r})\nexcept SystemExit as exc:\n    code = exc.code\n"
        f"print(json.dumps([code, [m for m in {HEAVY!r} if m in sys.modules]]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "LLMKIT_PLUGINS": ""},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    status, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    if expect is not None:
        assert status == expect, proc.stderr
    return heavy


def test_reading_a_spec_and_the_registry_imports_no_torch():
    """The spec layer itself (reading files, the outer structure, the schema's machinery)
    and the registry are torch-free: what stands in the way is the component modules."""
    code = (
        "import sys\nimport llmkit.spec, llmkit.spec.schema\n"
        "from llmkit.registry import get_registry\n"
        "from llmkit.spec import load_raw\n"
        "from llmkit.spec.sections import cached_spec_model\n"
        f"load_raw({str(SPECS / 'tiny.toml')!r})\n"
        "cached_spec_model(get_registry())\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("bad-toml", "[model\nvocab_size = 64\n"),
        ("missing-requires", 'requires = ["llmkit-not-installed>=1"]\n[model]\nvocab_size = 64\n'),
    ],
    ids=["bad-toml", "missing-requires"],
)
def test_validate_reports_a_spec_that_does_not_load_without_importing_torch(tmp_path, name, text):
    """Not even ``--build`` imports torch for a spec that does not load."""
    spec = tmp_path / f"{name}.toml"
    spec.write_text(text, encoding="utf-8")
    assert heavy_after(["validate", "--build", str(spec)], expect=2) == []


@pytest.mark.parametrize(
    "argv",
    [["validate", str(SPECS / "tiny.toml")], ["show", "attention", "sdpa"], ["schema"]],
    ids=lambda argv: argv[0],
)
def test_commands_that_need_no_model_import_no_torch(argv):
    """``schema`` reads every component's options model, so every one of them is torch-free."""
    assert heavy_after(argv, expect=0) == []
