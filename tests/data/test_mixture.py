"""Weighted mixtures: dealing rows by weight, exact resume, curriculum, the spec's checks and
a run that trains and evaluates per source."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from llmkit.data import BlockSampler, TokenFile, make_sampler
from llmkit.data.mixture import MixtureSampler, deal_rows, interleave_by_bytes, normalised
from llmkit.errors import LlmkitError, SpecError
from llmkit.spec import load_spec_dict
from llmkit.training import train
from tests.helpers import write_train_spec
from tests.training.kill_resume import read_metrics


def test_rows_follow_the_weights_within_one_row_at_every_point():
    weights = normalised([0.5, 0.3, 0.2])
    taken = [0, 0, 0]
    drawn = np.zeros(3)
    for _ in range(500):
        counts = deal_rows(weights, taken, 7)
        assert sum(counts) == 7
        drawn += counts
        assert np.abs(drawn - np.array(weights) * drawn.sum()).max() <= 1.0
    shares = drawn / drawn.sum()
    assert np.allclose(shares, weights, atol=0.01)


def test_a_tiny_weight_still_gets_its_share():
    weights = normalised([999, 1])
    taken = [0, 0]
    total = [0, 0]
    for _ in range(100):
        for i, n in enumerate(deal_rows(weights, taken, 20)):
            total[i] += n
    assert total == [1998, 2]


def test_bad_weights_are_refused():
    for bad in ([], [1, 0], [1, -2], [1, float("nan")]):
        with pytest.raises(LlmkitError, match="weights"):
            normalised(bad)


def test_texts_interleave_by_bytes():
    a = iter(["a" * 10] * 100)
    b = iter(["b" * 10] * 100)
    texts = list(interleave_by_bytes([a, b], [0.75, 0.25]))
    first = texts[:40]
    assert sum(t[0] == "a" for t in first) == 30  # 3:1 by bytes
    assert len(texts) == 200  # an exhausted stream drops out, the other goes on


def _samplers(seed=0, **kw):
    a = np.arange(1000, dtype=np.uint16)
    b = np.arange(5000, 5400, dtype=np.uint16)
    return [BlockSampler(a, 8, seed, **kw), make_sampler("random", b, 8, seed + 1, **kw)]


def _mixture(weights=(0.7, 0.3), **kw) -> MixtureSampler:
    return MixtureSampler(["big", "small"], list(weights), _samplers(**kw))


def test_batches_mix_the_sources_and_report_shares():
    m = _mixture()
    x, y = m.next_batch(10)
    assert x.shape == (10, 8) and torch.equal(x[:, 1:], y[:, :-1])
    from_small = int((x[:, 0] >= 5000).sum())
    assert from_small == 3
    for _ in range(99):
        m.next_batch(10)
    assert m.shares() == pytest.approx({"big": 0.7, "small": 0.3}, abs=1e-3)
    line = m.describe_shares(8, [1000, 400])
    assert "big 70.0% (weight 70.0%" in line and "small 30.0%" in line


def test_resume_gives_the_batches_an_uninterrupted_sampler_gives():
    full = _mixture()
    expected = [full.next_batch(6) for _ in range(40)]
    part = _mixture()
    for _ in range(17):
        part.next_batch(6)
    state = part.state_dict()
    resumed = _mixture()
    resumed.load_state_dict(state)
    assert resumed.change is None
    for want in expected[17:]:
        got = resumed.next_batch(6)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_changed_weights_on_resume_are_said_and_count_from_there():
    m = _mixture()
    for _ in range(10):
        m.next_batch(10)
    state = m.state_dict()
    later = _mixture((0.2, 0.8))
    later.load_state_dict(state)
    assert later.change is not None and "big 70.0% → 20.0%" in later.change
    before = list(later.rows)
    for _ in range(10):
        later.next_batch(10)
    new_rows = [a - b for a, b in zip(later.rows, before, strict=True)]
    assert new_rows == [20, 80]


def test_resume_refuses_other_sources_or_a_single_source_position():
    state = _mixture().state_dict()
    other = MixtureSampler(["big", "other"], [1, 1], _samplers())
    with pytest.raises(LlmkitError, match="sources changed"):
        other.load_state_dict(state)
    with pytest.raises(LlmkitError, match="not a mixture"):
        _mixture().load_state_dict({"epoch": 0, "index": 3, "world_size": 1})


def test_ranks_draw_disjoint_rows_from_every_source():
    seen = []
    for rank in range(2):
        m = MixtureSampler(
            ["big", "small"],
            [0.5, 0.5],
            [
                BlockSampler(np.arange(4000), 8, 3, rank=rank, world_size=2),
                BlockSampler(np.arange(10_000, 14_000), 8, 4, rank=rank, world_size=2),
            ],
        )
        starts = set()
        for _ in range(20):
            x, _ = m.next_batch(8)
            starts |= {int(v) for v in x[:, 0]}
        seen.append(starts)
    assert not seen[0] & seen[1]
    assert any(s >= 10_000 for s in seen[0]) and any(s < 4000 for s in seen[0])


def _mixture_spec(tmp, mixture):
    return {
        "model": {"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32},
        "data": {"mixture": mixture},
    }


@pytest.mark.parametrize(
    ("mixture", "message"),
    [
        (
            [
                {"source": {"name": "text", "paths": ["a"]}, "weight": 1},
                {"source": {"name": "text", "paths": ["a"]}, "weight": 2},
            ],
            "name one source twice",
        ),
        (
            [
                {"source": {"name": "text", "paths": ["a"]}, "weight": 1},
                {"source": {"name": "text", "paths": ["b"]}, "weight": 2},
            ],
            "both called 'text'",
        ),
        ([{"source": {"name": "text", "paths": ["a"]}, "weight": 0}], "weight"),
        ([{"source": {"name": "text", "paths": ["a"]}, "weight": -1}], "weight"),
        ([{"name": "a b", "source": {"name": "text", "paths": ["a"]}, "weight": 1}], "name"),
        ([{"source": {"name": "nope"}, "weight": 1}], "nope"),
    ],
)
def test_bad_mixtures_are_spec_errors(tmp_path, mixture, message):
    with pytest.raises(SpecError, match=message) as err:
        load_spec_dict(_mixture_spec(tmp_path, mixture))
    assert "data.mixture" in str(err.value)


def test_a_mixture_replaces_the_inherited_source():
    spec = _mixture_spec(
        None,
        [
            {"name": "a", "source": {"name": "text", "paths": ["x"]}, "weight": 3},
            {"name": "b", "source": {"name": "jsonl", "paths": ["y"]}, "weight": 1},
        ],
    )
    spec["data"]["source"] = {"name": "python-stdlib"}
    rs = load_spec_dict(spec)
    assert rs.dataset is None and [p.name for p in rs.mixture] == ["a", "b"]
    out = rs.to_dict()["data"]
    assert "source" not in out and out["mixture"][1]["source"]["name"] == "jsonl"
    one = rs.with_source(rs.mixture[1].source)
    assert one.dataset.name == "jsonl" and not one.mixture and "mixture" not in one.raw["data"]


def _two_corpora(tmp_path):
    prose = ("the cat sat on the mat and the dog lay by the door. " * 40 + "\n") * 30
    code = ("def f(x):\n    return x * 2 + 1\n\n" * 30 + "\n") * 30
    spec_path = write_train_spec(
        tmp_path, prose, max_steps=16, eval_interval=8, checkpoint_interval=4, batch_size=5
    )
    (tmp_path / "code.txt").write_text(code)
    spec = yaml.safe_load(spec_path.read_text())
    spec["data"] = {
        "mixture": [
            {"name": "prose", "source": spec["data"]["source"], "weight": 0.6},
            {
                "name": "code",
                "source": {
                    "name": "text",
                    "paths": [str(tmp_path / "code.txt")],
                    "val_fraction": 0.1,
                },
                "weight": 0.4,
            },
        ]
    }
    spec_path.write_text(yaml.safe_dump(spec))
    return spec_path


def test_a_mixture_trains_and_reports_each_source(tmp_path):
    # (a killed mixture job resuming exactly: tests/training/test_distributed_data.py)
    spec = _two_corpora(tmp_path)
    full = tmp_path / "full"
    train(spec, run_dir=full, log=lambda _m: None, progress=False)
    full_m = read_metrics(full)
    evals = [m for m in full_m if "val_loss" in m]
    assert [m["step"] for m in evals] == [8, 16]
    last = evals[-1]
    for name in ("prose", "code"):
        assert np.isfinite(last[f"val_loss/{name}"]) and np.isfinite(last[f"val_ce/{name}"])
    mixed = 0.6 * last["val_ce/prose"] + 0.4 * last["val_ce/code"]
    assert last["val_ce"] == pytest.approx(mixed, abs=2e-6)
    assert last["share/prose"] == pytest.approx(0.6, abs=0.01)
    assert last["share/code"] == pytest.approx(0.4, abs=0.01)
    # llmkit eval of a mixture run reads every source's validation split
    from llmkit.evaluation.perplexity import validation_text
    from llmkit.runs import load_run

    text = validation_text(load_run(full))
    assert "mixture (prose, code)" in text.source
    sizes = [len(TokenFile(p)) for p in (full / "data").glob("validation-*.bin")]
    assert len(sizes) == 2 and len(text.tokens) == sum(sizes)
