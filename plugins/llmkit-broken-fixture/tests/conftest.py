"""The fixture is never installed where the user works: each test that needs its entry point
gets a throwaway install (a site directory with its module and a ``.dist-info``) on sys.path."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent
MODULE = "llmkit_broken_fixture"


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fixture installed, as pip would, into a temporary site directory on sys.path."""
    meta = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    site = tmp_path / "site"
    shutil.copytree(PACKAGE / MODULE, site / MODULE, ignore=shutil.ignore_patterns("__pycache__"))
    info = site / f"{MODULE}-{meta['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n"
    )
    eps = "".join(f"{k} = {v}\n" for k, v in meta["entry-points"]["llmkit"].items())
    (info / "entry_points.txt").write_text(f"[llmkit]\n{eps}")
    monkeypatch.syspath_prepend(str(site))
    return site
