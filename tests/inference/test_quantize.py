"""Int8 weight quantization: what is quantized, what is kept, tied heads, size and accuracy."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from llmkit import cli
from llmkit.data.tokenizer import train_char
from llmkit.inference import Generator, Sampling, generate_batch
from llmkit.inference.quantize import Int8Linear, dynamic_available, quantize_model, weight_bytes
from llmkit.model import build_model
from llmkit.runs import TOKENIZER_FILE, save_spec
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

BACKENDS = ["weight_only"] + (["dynamic"] if dynamic_available() else [])


def _model(**model):
    torch.manual_seed(0)
    spec = tiny_spec(d_model=64, vocab_size=128, position={"name": "rope"}, **model)
    return build_model(load_spec_dict(spec)).eval()


def test_int8_linear_is_per_channel_symmetric():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    with torch.no_grad():
        lin.weight[0] *= 100  # one large row must not cost the others their precision
    q = Int8Linear.from_float(lin)
    assert q.weight.dtype == torch.int8 and q.scale.shape == (8,)
    assert int(q.weight.abs().max()) == 127
    err = (q.dequantized() - lin.weight).abs()
    assert bool((err <= q.scale[:, None] / 2 + 1e-7).all())  # round-to-nearest, per row
    x = torch.randn(3, 5, 16)
    exact = torch.nn.functional.linear(x, q.dequantized(), lin.bias)
    torch.testing.assert_close(q(x), exact, atol=1e-5, rtol=1e-5)
    assert float(q.scale[1:].max()) < float(q.scale[0]) / 20  # small rows keep small steps
    assert q.weight_nbytes() == 16 * 8 + 8 * 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_model_keeps_embeddings_and_a_tied_head(backend):
    model = _model()
    q = quantize_model(model, backend=backend)
    assert q is not model and type(model.layers[0].attn.qkv) is nn.Linear  # a copy
    assert q.quantization.backend == backend
    linears = [m for m in q.modules() if type(m) is nn.Linear]
    assert linears == [q.lm_head]  # every block linear is quantized; the tied head is not
    assert q.lm_head.weight is q.tok_emb.weight and q.tok_emb.weight.dtype == torch.float32
    assert q.quantization.linears == 4 * len(model.layers)
    idx = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ref, got = model(idx).logits, q(idx).logits
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    fp32, int8 = weight_bytes(model), weight_bytes(q)
    lins = [m for m in model.modules() if type(m) is nn.Linear and m is not model.lm_head]
    block = sum(m.weight.numel() for m in lins)
    channels = sum(m.out_features for m in lins)
    # 4 bytes → 1 per weight, plus per-channel scales (and zero points, for dynamic)
    assert 3 * block - 16 * channels <= fp32 - int8 <= 3 * block - 4 * channels


@pytest.mark.parametrize("backend", BACKENDS)
def test_untied_head_is_quantized_and_head_flag_overrides(backend):
    model = _model(tie_embeddings=False)
    q = quantize_model(model, backend=backend)
    assert not any(type(m) is nn.Linear for m in q.modules())
    assert q.tok_emb.weight.dtype == torch.float32
    kept = quantize_model(model, backend=backend, head=False)
    assert type(kept.lm_head) is nn.Linear
    tied = quantize_model(_model(), backend=backend, head=True)
    assert type(tied.lm_head) is not nn.Linear and tied.tok_emb.weight.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_model_generates_with_the_kv_cache(backend):
    model = _model()
    q = quantize_model(model, backend=backend)
    prompts = [[1, 2, 3, 4], [5]]
    cfg = Sampling(max_new_tokens=10, temperature=0)
    got = generate_batch(q, prompts, cfg)
    assert [len(r.ids) for r in got] == [10, 10]
    seq = torch.tensor([prompts[0]])
    with torch.no_grad():
        for _ in range(10):
            seq = torch.cat([seq, q(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert got[0].ids == seq[0, 4:].tolist()


def test_errors():
    model = _model()
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(model, "int4")
    with pytest.raises(ValueError, match="unknown backend"):
        quantize_model(model, backend="magic")


def test_cli_eval_reports_both_sizes_and_perplexities(tmp_path, capsys):
    tok = train_char(["hello there, general kenobi.\n"])
    spec = tiny_spec(vocab_size=tok.vocab_size, d_model=64, position={"name": "rope"})
    spec["tokenizer"] = {"kind": "char"}
    rs = load_spec_dict(spec)
    torch.manual_seed(0)
    save_spec(rs, tmp_path)
    save_weights(build_model(rs), tmp_path / WEIGHTS)
    tok.save(tmp_path / TOKENIZER_FILE)
    data = tmp_path / "text.txt"
    data.write_text("hello there, general kenobi.\n" * 8)
    argv = ["eval", str(tmp_path), "--data", str(data), "--quantize", "int8", "--device", "cpu"]
    assert cli.main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    err = captured.err  # with --json the human report goes to stderr, the JSON to stdout
    assert "int8" in err and "smaller" in err and "perplexity" in err
    report = json.loads(captured.out)
    assert report["int8"]["weight_bytes"] < report["weight_bytes"]
    assert abs(report["int8"]["loss"] - report["loss"]) < 0.05
    assert Generator(str(tmp_path), quantize="int8").generate("he", max_new_tokens=3)[0].ids
