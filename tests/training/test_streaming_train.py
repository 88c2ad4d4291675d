"""``data.streaming``: what cannot be streamed is one line. (A streamed job's disjoint rows
and exact resume after SIGKILL: tests/training/test_distributed_data.py; the sampler's own
resume with DataLoader workers: tests/data/test_stream_sampler.py.)"""

from __future__ import annotations

import pytest
import yaml

from llmkit.errors import LlmkitError
from llmkit.training import train
from tests.training.test_distributed_data import stream_spec


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
