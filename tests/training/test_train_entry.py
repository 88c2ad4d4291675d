"""One path for each thing: ``train()`` resolves the spec once (the tokenizer's vocabulary is
settled without resolving again), and the end-of-training sample comes from the model in
memory, not from a reload of the run."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
import yaml

from llmkit.inference import Generator, Sampling
from llmkit.runs import load_run
from llmkit.training import sample_text, train
from tests.helpers import write_train_spec

#: (``llmkit.spec.resolve`` the attribute is the function; this is the module.)
resolve_mod = importlib.import_module("llmkit.spec.resolve")

CORPUS = "It was the best of times, it was the worst of times.\n" * 80


@pytest.fixture
def resolutions(monkeypatch) -> list[int]:
    """One entry per spec resolution from now on, however ``resolve`` was imported (each
    resolution makes one ``_Resolver``)."""
    seen: list[int] = []

    class Counting(resolve_mod._Resolver):
        def __init__(self, registry):
            seen.append(1)
            super().__init__(registry)

    monkeypatch.setattr(resolve_mod, "_Resolver", Counting)
    return seen


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, object]:
    tmp = tmp_path_factory.mktemp("entry")
    spec = write_train_spec(tmp, CORPUS, max_steps=4, eval_interval=4, sample_tokens=16)
    result = train(spec, run_dir=tmp / "run", log=lambda _m: None, progress=False)
    return tmp / "run", result


def test_the_spec_is_resolved_once_and_takes_the_tokenizers_vocabulary(tmp_path, resolutions):
    logs: list[str] = []
    spec = write_train_spec(tmp_path, CORPUS, max_steps=2, eval_interval=2)
    result = train(spec, run_dir=tmp_path / "run", log=logs.append, progress=False)
    assert len(resolutions) == 1
    vocab = result.tokenizer.vocab_size
    assert vocab < 64 and any(f"vocab_size 64 -> {vocab}" in m for m in logs)
    assert result.spec.model.vocab_size == vocab == result.model.tok_emb.num_embeddings
    saved = yaml.safe_load((tmp_path / "run" / "spec.yaml").read_text())
    resolved = json.loads((tmp_path / "run" / "resolved.json").read_text())
    assert saved["model"]["vocab_size"] == resolved["model"]["vocab_size"] == vocab

    resolutions.clear()  # resumed with --set: the saved spec is read, resolved once with it
    result = train(
        run_dir=tmp_path / "run",
        resume=True,
        overrides=["train.max_steps=3", "optimizer.lr=1e-3"],
        log=lambda _m: None,
        progress=False,
    )
    assert result.step == 3 and len(resolutions) == 1
    assert result.spec.source == str(tmp_path / "run" / "spec.yaml")


def test_the_result_holds_the_trained_model_and_its_tokenizer(trained):
    run, result = trained
    assert result.model is not None and result.tokenizer is not None
    saved = load_run(run).model.state_dict()
    for name, tensor in result.model.state_dict().items():
        assert torch.equal(tensor.cpu(), saved[name]), name


def test_the_sample_comes_from_the_model_in_memory(trained):
    run, result = trained
    t = result.spec.spec.train
    text = sample_text(result)
    assert text is not None and text.startswith(t.sample_prompt)
    sampling = Sampling(max_new_tokens=16, temperature=0.8, top_k=50, seed=t.seed)
    if not t.sample_prompt:
        sampling.ignore_eos = True
    reloaded = Generator(load_run(run)).generate(t.sample_prompt, sampling)[0].text
    assert text == t.sample_prompt + reloaded  # what the reload used to print
    assert sample_text(result) == text  # seeded


def test_no_sample_without_tokens_or_model(trained):
    import dataclasses

    _, result = trained
    assert sample_text(dataclasses.replace(result, model=None)) is None
    quiet = result.spec.spec.train.model_copy(update={"sample_tokens": 0})
    spec = result.spec.spec.model_copy(update={"train": quiet})
    assert (
        sample_text(dataclasses.replace(result, spec=dataclasses.replace(result.spec, spec=spec)))
        is None
    )
