"""The CPU decoding weight layout (column-major for one or two rows)."""

from __future__ import annotations

import pytest
import torch

from llmkit.inference import Generator, Sampling, generate_batch, prepare_for_decoding
from llmkit.model import build_model
from llmkit.registry import get_registry
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec


def test_decoding_layout_keeps_values_ties_and_training(tmp_path, run_dir):
    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec(position={"name": "rope"}))).eval()
    before = model.lm_head.weight.detach().clone()
    idx = torch.randint(0, 64, (2, 8))
    logits = model(idx).logits.detach()
    generate_batch(model, [[1, 2, 3]], Sampling(max_new_tokens=3, temperature=0))
    assert model.lm_head.weight.is_contiguous()  # a model passed in is left alone
    prepare_for_decoding(model)
    w = model.lm_head.weight
    assert w.stride() == (1, 64)  # column-major on CPU
    assert w is model.tok_emb.weight and torch.equal(w, before)
    torch.testing.assert_close(model(idx).logits, logits, atol=1e-5, rtol=1e-5)
    model.train()
    model(idx, idx).loss.backward()  # still an ordinary trainable parameter
    assert w.grad is not None and w.grad.shape == w.shape
    prepare_for_decoding(model, column_major=False)
    assert w.is_contiguous() and torch.equal(w, before)
    save_weights(model, tmp_path / WEIGHTS)
    loaded = Generator(str(run_dir)).model  # models llmkit loads get the layout
    assert loaded.lm_head.weight.stride() == (1, loaded.lm_head.weight.shape[0])


def _is_col(w: torch.Tensor) -> bool:
    return w.stride() == (1, w.shape[0])


def test_decoding_layout_follows_the_number_of_rows():
    """Linears with out ≥ in and the head go column-major for one or two rows, back to
    row-major for more, and the generated tokens never depend on the layout."""
    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec(ffn={"name": "mlp", "multiplier": 4.0}))).eval()
    plain = build_model(load_spec_dict(tiny_spec(ffn={"name": "mlp", "multiplier": 4.0}))).eval()
    plain.load_state_dict(model.state_dict())
    block = model.layers[0]
    wide, narrow = block.ffn.in_proj.weight, block.ffn.out_proj.weight  # (128, 32), (32, 128)
    cfg = Sampling(max_new_tokens=6, temperature=0, ignore_eos=True)
    one, four = [[1, 2, 3]], [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]

    prepare_for_decoding(model)
    assert _is_col(wide) and _is_col(block.attn.qkv.weight) and _is_col(model.lm_head.weight)
    assert narrow.is_contiguous() and not _is_col(narrow)  # fewer outputs than inputs
    assert generate_batch(model, one, cfg)[0].ids == generate_batch(plain, one, cfg)[0].ids
    assert _is_col(wide)
    got = [r.ids for r in generate_batch(model, four, cfg)]
    assert wide.is_contiguous() and model.lm_head.weight.is_contiguous()  # switched back
    assert got == [r.ids for r in generate_batch(plain, four, cfg)]
    beams = Sampling(max_new_tokens=4, num_beams=3)
    generate_batch(model, one, beams)  # 3 rows decode at once
    assert wide.is_contiguous()
    generate_batch(model, one, cfg)
    assert _is_col(wide)  # and back again for one row
    assert plain.layers[0].ffn.in_proj.weight.is_contiguous()  # never prepared: left alone

    prepare_for_decoding(model, column_major=False)
    assert wide.is_contiguous() and model.lm_head.weight.is_contiguous()
    generate_batch(model, one, cfg)
    assert wide.is_contiguous()  # switching stopped


@pytest.mark.parametrize("ffn", [c.name for c in get_registry().list("ffn")])
def test_every_feed_forward_accepts_the_decoding_layout(ffn):
    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec(ffn={"name": ffn}))).eval()
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(idx).logits
        prepare_for_decoding(model)
        torch.testing.assert_close(model(idx).logits, before, atol=1e-5, rtol=1e-5)
        cache = model.new_cache()
        inc = torch.cat(
            [model(idx[:, :5], cache=cache).logits]
            + [model(idx[:, t : t + 1], cache=cache).logits for t in range(5, 8)],
            1,
        )
    torch.testing.assert_close(inc, before, atol=2e-5, rtol=1e-4)


def test_llmkit_generate_decodes_with_the_layout(run_dir, monkeypatch, capsys):
    from llmkit.cli import main
    from llmkit.inference import generator

    made: list[Generator] = []
    real = generator.Generator.__init__

    def keeping(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(generator.Generator, "__init__", keeping)
    argv = ["generate", str(run_dir), "--prompt", "the ", "--max-new-tokens", "3"]
    assert main([*argv, "--temperature", "0"]) == 0
    (gen,) = made
    assert gen.model._llmkit_decoding_layout and _is_col(gen.model.lm_head.weight)
