"""Checkpoint files: damaged weights, state and pointers are named, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from llmkit.errors import LlmkitError
from llmkit.runs.checkpoints import Checkpoints, DamagedCheckpoint, load_state, load_weights


def _saved(tmp_path: Path, steps=(1, 2, 3)) -> Checkpoints:
    ckpts = Checkpoints(tmp_path, keep=len(steps))
    for step in steps:
        torch.manual_seed(step)
        ckpts.save(step, nn.Linear(3, 2), {"step": step}, {"val_loss": 1.0 / step}, best=True)
    return ckpts


def test_truncated_or_foreign_weights_are_a_damaged_checkpoint(tmp_path):
    ckpts = _saved(tmp_path)
    weights = ckpts.latest() / "model.safetensors"
    data = weights.read_bytes()
    for broken in (data[:100], b"\x00" * 64, b"not safetensors at all"):
        weights.write_bytes(broken)
        with pytest.raises(DamagedCheckpoint, match="unreadable weights"):
            load_weights(nn.Linear(3, 2), weights)


def test_weights_of_another_shape_are_named_and_not_called_damaged(tmp_path):
    weights = _saved(tmp_path).latest() / "model.safetensors"
    with pytest.raises(
        LlmkitError, match=r"2 tensors differ, e.g. bias is \(2,\) in the file and \(4,\)"
    ) as info:
        load_weights(nn.Linear(3, 4), weights)
    assert not isinstance(info.value, DamagedCheckpoint)
    with pytest.raises(LlmkitError, match="missing"):
        load_weights(nn.Sequential(nn.Linear(3, 2)), weights)


def test_truncated_state_is_a_damaged_checkpoint(tmp_path):
    latest = _saved(tmp_path).latest()
    assert load_state(latest) == {"step": 3}
    state = latest / "state.pt"
    state.write_bytes(state.read_bytes()[:50])
    with pytest.raises(DamagedCheckpoint, match="unreadable trainer state"):
        load_state(latest)
    state.unlink()
    with pytest.raises(DamagedCheckpoint, match=r"has no state\.pt"):
        load_state(latest)


def test_a_failing_disk_is_not_taken_for_a_damaged_file(tmp_path, monkeypatch):
    """OSError (EIO, ESTALE, too many open files) propagates: a transient read error must
    not make a resume drop the newest checkpoint."""
    latest = _saved(tmp_path).latest()

    def failing(*_a, **_k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("llmkit.runs.checkpoints.safe_open", failing)
    with pytest.raises(OSError, match="Input/output error"):
        load_weights(nn.Linear(3, 2), latest / "model.safetensors")
    monkeypatch.setattr("llmkit.runs.checkpoints.torch.load", failing)
    with pytest.raises(OSError, match="Input/output error"):
        load_state(latest)


@pytest.mark.parametrize(
    "pointer",
    ["{garbage", "", "{}", '{"dir": 3}', '["step-000002"]', '{"dir": ""}', '{"dir": "/"}'],
)
def test_a_damaged_latest_pointer_falls_back_to_the_newest_checkpoint(tmp_path, pointer):
    ckpts = _saved(tmp_path)
    (ckpts.dir / "latest.json").write_text(pointer)
    (ckpts.dir / "best.json").write_text(pointer)
    assert ckpts.latest() == ckpts.dir / "step-000003"
    assert ckpts.best() is None


def test_a_pointer_to_a_missing_directory_falls_back(tmp_path):
    ckpts = _saved(tmp_path)
    (ckpts.dir / "latest.json").write_text(json.dumps({"step": 9, "dir": "step-000009"}))
    assert ckpts.latest() == ckpts.dir / "step-000003"
    (ckpts.dir / "latest.json").unlink()
    assert ckpts.latest() == ckpts.dir / "step-000003"


def test_resume_order_is_latest_then_older(tmp_path):
    ckpts = _saved(tmp_path)
    names = lambda: [p.name for p in ckpts.newest_first()]  # noqa: E731
    assert names() == ["step-000003", "step-000002", "step-000001"]
    (ckpts.dir / "latest.json").write_text(json.dumps({"step": 2, "dir": "step-000002"}))
    assert names() == ["step-000002", "step-000003", "step-000001"]
    assert Checkpoints(tmp_path / "none").newest_first() == []


def test_meta_records_a_checksum_per_file_and_a_change_is_named(tmp_path):
    from llmkit.runs.checkpoints import read_meta, verify_files

    latest = _saved(tmp_path).latest()
    sums = read_meta(latest)["files"]
    assert sorted(sums) == ["model.safetensors", "state.pt"]
    verify_files(latest, sums)
    weights = latest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpoint, match=r"model\.safetensors: contents differ"):
        verify_files(latest, ["model.safetensors"])
    (latest / "meta.json").unlink()
    with pytest.raises(DamagedCheckpoint, match=r"has no meta\.json"):
        verify_files(latest, ["state.pt"])
