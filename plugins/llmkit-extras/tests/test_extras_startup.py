"""With the plugin installed, the commands that need no model still import no torch: every
component registers its options as ``"llmkit_extras.options:<Class>"``, a module that imports
none, so ``llmkit schema``, ``validate`` and ``show`` read them without the component modules.

Each command runs in a fresh interpreter with ``LLMKIT_PLUGINS`` unset, so every installed
plugin loads (as for a user), and the test reads ``sys.modules`` afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from llmkit_extras.dyt import DynamicTanh
from llmkit_extras.options import DyTOptions, QKNormOptions, ScaleNormOptions
from llmkit_extras.qk_norm import QKNorm
from llmkit_extras.scalenorm import ScaleNorm

from llmkit import Registry

HEAVY = ("torch", "triton", "datasets")
SPEC = Path(__file__).resolve().parent.parent / "specs" / "tiny-extras.toml"


def heavy_after(code: str) -> list[str]:
    """The heavy libraries imported by ``code`` in a fresh interpreter with every installed
    plugin loaded."""
    code += f"\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("LLMKIT_PLUGINS", "LLMKIT_STRICT_PLUGINS", "LLMKIT_REGISTRY"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_options_are_registered_lazily_from_a_torch_free_module():
    reg = Registry()
    reg.load_entry_points(["extras"])
    records = [c for kind in reg.kinds for c in reg.list(kind) if c.provider == "llmkit-extras"]
    assert len(records) == 5
    for record in records:
        assert isinstance(record.options, str), record.key
        assert record.options.startswith("llmkit_extras.options:"), record.key
    assert heavy_after("import llmkit_extras.options") == []


def test_the_component_modules_keep_their_options():
    assert DynamicTanh.Options is DyTOptions
    assert ScaleNorm.Options is ScaleNormOptions
    assert QKNorm.Options is QKNormOptions


@pytest.mark.parametrize(
    ("argv", "shows"),
    [
        (["schema"], "alpha_beta3_warmup"),
        (["validate", str(SPEC)], "valid"),
        (["show", "norm", "dyt"], "alpha_init"),
        (["show", "qk_transform", "qk_norm"], "shared"),
        (["show", "optimizer", "ademamix"], "alpha_beta3_warmup"),
        (["show", "schedule", "rex"], "min_lr_ratio"),
    ],
    ids=["schema", "validate", "show-dyt", "show-qk_norm", "show-ademamix", "show-rex"],
)
def test_commands_that_need_no_model_import_no_torch(argv, shows):
    code = (
        "import contextlib, io\nfrom llmkit.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        f"    code = main({argv!r})\n"
        "assert code == 0, (code, out.getvalue())\n"
        f"assert {shows!r} in out.getvalue(), out.getvalue()\n"
    )
    assert heavy_after(code) == []
