"""``data.document_mask`` in training: packed rows are attended per document (the objective
passes the model document ids from the tokenizer's EOS), and bad set-ups are one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from llmkit.errors import LlmkitError
from llmkit.model.objective import Objective
from llmkit.training import train
from tests.helpers import write_train_spec

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]


def jsonl_spec(tmp_path: Path, **data) -> Path:
    """A char-level spec over short JSONL documents (many per 32-token row)."""
    rng = random.Random(0)
    docs = tmp_path / "docs.jsonl"
    with docs.open("w") as f:
        for _ in range(600):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
            f.write(json.dumps({"text": text}) + "\n")
    path = write_train_spec(tmp_path, "unused", max_steps=2, eval_interval=2)
    spec = yaml.safe_load(path.read_text())
    spec["data"] = {"source": {"name": "jsonl", "paths": [str(docs)]}, **data}
    path.write_text(yaml.safe_dump(spec))
    return path


def _first_losses(spec: Path, out: Path, *sets: str) -> list[float]:
    result = train(spec, run_dir=out, overrides=list(sets), log=lambda _m: None, progress=False)
    return [h["loss"] for h in result.history if "loss" in h]


def test_document_mask_changes_what_packed_rows_attend_to(tmp_path):
    spec = jsonl_spec(tmp_path)
    plain = _first_losses(spec, tmp_path / "plain")
    masked = _first_losses(spec, tmp_path / "masked", "data.document_mask=true")
    assert len(plain) == len(masked) == 2
    assert all(torch.isfinite(torch.tensor(masked)))
    # same weights, same first batch: only the attention pattern differs
    assert abs(plain[0] - masked[0]) > 1e-4


def test_the_objective_gives_the_model_document_ids():
    seen = {}

    def forward(x, y=None, **kw):
        seen.update(kw)

        from llmkit.model.transformer import ModelOutput

        return ModelOutput(None, torch.tensor(1.0), {}, {})

    x = torch.tensor([[5, 0, 7, 7, 0, 9]])
    Objective(document_eos=0)(forward, x, x)
    assert seen["document_ids"].tolist() == [[0, 0, 1, 1, 1, 2]]
    seen.clear()
    Objective()(forward, x, x)
    assert seen == {}


def test_document_mask_needs_an_end_of_text_token(tmp_path):
    spec = jsonl_spec(tmp_path)
    sets = ["data.document_mask=true", "tokenizer.special_tokens=[]"]
    with pytest.raises(LlmkitError, match="no end-of-text token"):
        train(spec, run_dir=tmp_path / "run", overrides=sets, log=lambda _m: None)
