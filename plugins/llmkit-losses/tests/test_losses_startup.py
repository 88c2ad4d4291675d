"""With the plugin installed, the commands that need no model still import no torch: every
loss registers its options as ``"llmkit_losses.options:<Class>"``, a module that imports none,
so ``llmkit schema``, ``validate`` (a spec's ``train.loss`` included) and ``show`` read them
without the loss modules.

Each command runs in a fresh interpreter with ``LLMKIT_PLUGINS`` unset, so every installed
plugin loads (as for a user), and the test reads ``sys.modules`` afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from llmkit_losses import base, options
from llmkit_losses.cross_entropy import CrossEntropy
from llmkit_losses.label_smoothing import LabelSmoothing
from llmkit_losses.z_loss import ZLoss

from llmkit import Registry

HEAVY = ("torch", "triton", "datasets")
SPEC = """\
[model]
vocab_size = 512
d_model = 32
n_layers = 2
n_heads = 4
max_seq_len = 16

[train]
loss = { name = "z_loss", weight = 1e-3, ignore_index = 0 }
"""


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
    reg.load_entry_points(["losses"])
    records = reg.list("loss")
    assert [r.name for r in records] == ["cross_entropy", "label_smoothing", "z_loss"]
    for record in records:
        assert isinstance(record.options, str), record.key
        assert record.options.startswith("llmkit_losses.options:"), record.key
    assert heavy_after("import llmkit_losses.options") == []


def test_the_loss_modules_keep_their_options():
    assert base.LossOptions is options.LossOptions and base.IGNORE_INDEX == -100
    assert CrossEntropy.Options is options.CrossEntropyOptions
    assert LabelSmoothing.Options is options.LabelSmoothingOptions
    assert ZLoss.Options is options.ZLossOptions
    assert all(
        issubclass(cls.Options, base.LossOptions) for cls in (CrossEntropy, LabelSmoothing, ZLoss)
    )


@pytest.mark.parametrize(
    ("argv", "shows"),
    [
        (["schema"], "smoothing"),
        (["validate", "{spec}"], "valid"),
        (["show", "loss", "z_loss"], "ignore_index"),
        (["show", "loss", "label_smoothing"], "smoothing"),
    ],
    ids=["schema", "validate", "show-z_loss", "show-label_smoothing"],
)
def test_commands_that_need_no_model_import_no_torch(tmp_path, argv, shows):
    spec = tmp_path / "loss.toml"
    spec.write_text(SPEC, encoding="utf-8")
    argv = [a.format(spec=spec) for a in argv]
    code = (
        "import contextlib, io\nfrom llmkit.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        f"    code = main({argv!r})\n"
        "assert code == 0, (code, out.getvalue())\n"
        f"assert {shows!r} in out.getvalue(), out.getvalue()\n"
    )
    assert heavy_after(code) == []


def test_validate_reports_a_bad_loss_option_without_importing_torch(tmp_path):
    spec = tmp_path / "bad.toml"
    spec.write_text(SPEC.replace("weight = 1e-3", "weight = -1.0"), encoding="utf-8")
    code = (
        "import contextlib, io\nfrom llmkit.cli import main\n"
        "with contextlib.redirect_stderr(io.StringIO()) as err:\n"
        f"    code = main(['validate', {str(spec)!r}])\n"
        "assert code != 0 and 'train.loss' in err.getvalue(), (code, err.getvalue())\n"
    )
    assert heavy_after(code) == []
