"""benchmarks/scripts/flash_tune.py: its dry run lists every candidate and writes its JSON."""

from __future__ import annotations

import json

from benchmarks.scripts import flash_tune


def test_dry_run_lists_every_candidate(tmp_path, capsys):
    assert flash_tune.main(["--dry-run", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "flash_tune.json").read_text())
    flash = [r for r in records if r["kind"] == "flash"]
    dense = len(flash_tune.FWD) + len(flash_tune.DKDV) + len(flash_tune.DQ)
    windowed = len(flash_tune.WFWD) + len(flash_tune.WDKDV) + len(flash_tune.WDQ)
    assert len(flash) == len(flash_tune.HEAD_DIMS) * (dense + windowed)
    assert {r["W"] for r in flash} == {0, flash_tune.WINDOW}
    norms = [r for r in records if r["kind"] == "rmsnorm"]
    assert len(norms) == 2 * len(flash_tune.NORM)


def test_flops_count_attended_pairs():
    # causal: n(n+1)/2 pairs; a window of n or more is the same
    assert flash_tune._flops(1, 1, 4, 1, "fwd") == 4 * 10
    assert flash_tune._flops(1, 1, 4, 1, "fwd", window=8) == 4 * 10
    # W 2 over 4 keys: 1 + 2 + 2 + 2 pairs; backward counts 2.5× the forward
    assert flash_tune._flops(1, 1, 4, 1, "fwd", window=2) == 4 * 7
    assert flash_tune._flops(1, 1, 4, 1, "bwd", window=2) == 2.5 * 4 * 7
