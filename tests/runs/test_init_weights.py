"""Finding an init_from source and copying its weights into a new model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file, save_model

from llmkit.errors import LlmkitError
from llmkit.model import build_model
from llmkit.runs.init_from import (
    ADAPTER_MARK,
    find_init_source,
    load_init_weights,
)
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec


def model(**over):
    torch.manual_seed(0)
    return build_model(load_spec_dict(tiny_spec(**over)))


def saved(tmp_path: Path, m, name="w.safetensors") -> Path:
    path = tmp_path / name
    save_model(m, str(path))
    return path


def test_a_safetensors_file_is_a_source(tmp_path):
    src = model()
    path = saved(tmp_path, src)
    (tmp_path / "tokenizer.json").write_text("{}")
    init = find_init_source(path)
    assert init.weights == path.absolute() and init.tokenizer == tmp_path / "tokenizer.json"
    dst = model(init_std=0.5)
    torch.manual_seed(1)
    dst = build_model(load_spec_dict(tiny_spec()))
    line = load_init_weights(dst, init, vocab_size=64)
    assert "tensors from" in line
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_a_checkpoints_weights_file_takes_its_runs_tokenizer(tmp_path):
    from llmkit.runs import SPEC_FILE, TOKENIZER_FILE
    from llmkit.runs.checkpoints import WEIGHTS

    run = tmp_path / "run"
    step = run / "checkpoints" / "step-10"
    step.mkdir(parents=True)
    (run / SPEC_FILE).write_text("model: {}\n")
    (run / TOKENIZER_FILE).write_text("{}")
    weights = saved(step, model(), WEIGHTS)
    assert find_init_source(weights).tokenizer == run / TOKENIZER_FILE
    (step / TOKENIZER_FILE).write_text("{}")  # one beside the file comes first
    assert find_init_source(weights).tokenizer == step / TOKENIZER_FILE
    alone = saved(tmp_path, model(), "alone.safetensors")
    assert find_init_source(alone).tokenizer is None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing", "not found"),
        (lambda d: (d / "x.txt").write_text("x") and d / "x.txt", "not a run"),
        (lambda d: (d / "empty").mkdir() or d / "empty", "not a run directory"),
    ],
)
def test_bad_sources_are_one_line_errors(tmp_path, make, message):
    with pytest.raises(LlmkitError, match=message) as info:
        find_init_source(make(tmp_path))
    assert "train.init_from" in str(info.value) and "\n" not in str(info.value)


def test_a_different_shape_is_refused_naming_the_parameter(tmp_path):
    init = find_init_source(saved(tmp_path, model(d_model=48)))
    with pytest.raises(
        LlmkitError,
        match=r"position\.wpe\.weight is \(32, 48\) in the source and \(32, 32\) in this model$",
    ):
        load_init_weights(model(), init, vocab_size=64)


def test_other_architectures_are_refused_naming_a_tensor(tmp_path):
    init = find_init_source(saved(tmp_path, model(n_layers=3)))
    with pytest.raises(LlmkitError, match=r"12 tensor\(s\) this model lacks, e\.g\. layers\.2\."):
        load_init_weights(model(), init, vocab_size=64)
    init = find_init_source(saved(tmp_path, model(n_layers=1), "one.safetensors"))
    with pytest.raises(LlmkitError, match=r"this model's layers\.1\.\S+ .* is not in the source"):
        load_init_weights(model(), init, vocab_size=64)


@pytest.mark.parametrize("tie", [True, False])
def test_vocabulary_resize_only_when_allowed(tmp_path, tie):
    src = model(vocab_size=64, tie_embeddings=tie)
    init = find_init_source(saved(tmp_path, src))
    with pytest.raises(LlmkitError, match="init_resize_vocab"):
        load_init_weights(model(vocab_size=80, tie_embeddings=tie), init, vocab_size=80)
    for n in (80, 40):  # grown and shrunk
        torch.manual_seed(5)
        dst = build_model(load_spec_dict(tiny_spec(vocab_size=n, tie_embeddings=tie)))
        fresh = dst.tok_emb.weight.detach().clone()
        line = load_init_weights(dst, init, vocab_size=n, resize_vocab=True)
        assert f"64->{n} rows" in line
        rows = min(n, 64)
        assert torch.equal(dst.tok_emb.weight[:rows], src.tok_emb.weight[:rows])
        assert torch.equal(dst.tok_emb.weight[rows:], fresh[rows:])  # new rows: fresh init
        if not tie:
            assert torch.equal(dst.lm_head.weight[:rows], src.lm_head.weight[:rows])
        assert torch.equal(
            dst.layers[0].attn.qkv.weight, src.layers[0].attn.qkv.weight
        )  # the rest as is


def test_adapter_only_weights_are_not_a_starting_point(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"x": torch.zeros(2)}, str(path), metadata={ADAPTER_MARK: "lora"})
    with pytest.raises(LlmkitError, match="merge-lora"):
        load_init_weights(model(), find_init_source(path), vocab_size=64)


def test_damaged_source_is_reported(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(LlmkitError, match="unreadable weights"):
        load_init_weights(model(), find_init_source(path), vocab_size=64)


def test_a_tied_model_refuses_an_untied_source_and_takes_a_tied_one(tmp_path):
    # An untied source's embedding and head are two tensors; one tied model parameter can
    # hold only one of them (the other was silently lost).
    untied = saved(tmp_path, model(tie_embeddings=False), "untied.safetensors")
    with pytest.raises(LlmkitError, match=r"ties tok_emb\.weight and lm_head\.weight"):
        load_init_weights(model(tie_embeddings=True), find_init_source(untied), vocab_size=64)
    src = model(tie_embeddings=True)
    tied = find_init_source(saved(tmp_path, src, "tied.safetensors"))
    dst = model(tie_embeddings=True, init_std=0.5)
    load_init_weights(dst, tied, vocab_size=64)
    assert torch.equal(dst.tok_emb.weight, src.tok_emb.weight)
