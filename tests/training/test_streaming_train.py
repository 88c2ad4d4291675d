"""``data.streaming`` end to end: a streamed run trains from JSONL files read by DataLoader
workers, validates on the held-out tail, and a SIGKILL resumes to the uninterrupted losses."""

from __future__ import annotations

import pytest
import yaml

from llmkit.errors import LlmkitError
from llmkit.training import train
from tests.training.kill_resume import losses, train_killed_and_resumed, val_losses
from tests.training.test_distributed_data import stream_spec


def test_a_streamed_run_resumes_exactly_after_a_kill(tmp_path):
    spec = stream_spec(tmp_path, workers=2)
    full, run, killed_at = train_killed_and_resumed(spec, tmp_path, kill_at=6)
    assert killed_at < 12
    assert len(losses(full)) == 12
    assert losses(run) == losses(full)
    assert val_losses(run) == val_losses(full)
    assert (full / "data").glob("validation-stream-*.bin")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"sampling": "random"}, "packed rows only"),
        ({"source": {"name": "python-stdlib"}}, "cannot be streamed"),
    ],
)
def test_what_cannot_stream_is_one_line(tmp_path, data, message):
    spec = stream_spec(tmp_path, workers=0)
    raw = yaml.safe_load(spec.read_text())
    raw["data"].update(data)
    spec.write_text(yaml.safe_dump(raw))
    with pytest.raises(LlmkitError, match=message):
        train(spec, run_dir=tmp_path / "run", log=lambda _m: None)
