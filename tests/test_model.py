"""The assembled Transformer: parameter counts, side outputs, init, cache, accounting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmkit import hookimpl
from llmkit.contracts import ComponentOptions, SideOutputs
from llmkit.model import build_model
from llmkit.spec import load_spec, load_spec_dict
from tests.conftest import SPECS
from tests.helpers import registry_with, tiny_spec


def meta_model(path):
    with torch.device("meta"):
        return build_model(load_spec(path))


@pytest.mark.parametrize(
    ("spec", "params"),
    [
        ("gpt2-small.toml", 124_439_808),  # GPT-2 small as released (Radford et al. 2019)
        ("llama-style.toml", 1_100_048_384),  # TinyLlama-1.1B
        ("mistral-style.toml", 7_241_732_096),  # Mistral-7B-v0.1
    ],
)
def test_parameter_counts_match_the_published_models(spec, params):
    assert meta_model(SPECS / spec).num_params() == params


def test_non_embedding_count_excludes_token_and_position_embeddings():
    model = meta_model(SPECS / "gpt2-small.toml")
    assert model.num_params(exclude_embeddings=True) == 124_439_808 - 50257 * 768 - 1024 * 768


def test_flops_per_token_follow_the_palm_formula():
    model = meta_model(SPECS / "gpt2-small.toml")
    n_matmul = 124_439_808 - 1024 * 768  # token embedding counted once as the output head
    expected_forward = 2 * n_matmul + 4 * 12 * 768 * 1024
    flops = model.flops_per_token(1024)
    assert flops["forward"] == expected_forward
    assert flops["train"] == 3 * expected_forward


def test_sliding_window_bounds_the_attention_flops_and_cache():
    dense = build_model(load_spec_dict(tiny_spec(max_seq_len=64)))
    window = build_model(
        load_spec_dict(tiny_spec(max_seq_len=64, attention={"name": "sliding_window", "window": 8}))
    )
    d, w = dense.flops_per_token(64), window.flops_per_token(64)
    assert d["forward"] - w["forward"] == 2 * 4 * 4 * 8 * (64 - 8)
    assert dense.kv_cache_bytes_per_token() == 2 * 2 * 4 * 8 * 4


def test_forward_shapes_loss_and_last_only():
    model = build_model(load_spec_dict(tiny_spec()))
    idx = torch.randint(0, 64, (2, 10))
    out = model(idx, idx)
    assert out.logits.shape == (2, 10, 64)
    assert out.loss is not None and torch.isfinite(out.loss)
    assert abs(out.loss.item() - torch.log(torch.tensor(64.0)).item()) < 0.5  # near uniform
    assert model(idx, last_only=True).logits.shape == (2, 1, 64)
    with pytest.raises(ValueError, match="no targets"):
        _ = model(idx).total_loss


def test_tied_and_untied_heads():
    tied = build_model(load_spec_dict(tiny_spec()))
    assert tied.lm_head.weight is tied.tok_emb.weight
    untied = build_model(load_spec_dict(tiny_spec(tie_embeddings=False)))
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 64 * 32


def test_scaled_residual_init():
    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec(d_model=256, n_layers=8, init_std=0.02)))
    out_std = model.layers[0].attn.out_proj.weight.std().item()
    in_std = model.layers[0].attn.qkv.weight.std().item()
    assert abs(in_std - 0.02) < 0.002
    assert abs(out_std - 0.02 / 4) < 0.001  # 1/sqrt(2·8)
    plain = build_model(
        load_spec_dict(tiny_spec(d_model=256, n_layers=8, scaled_residual_init=False))
    )
    assert abs(plain.layers[0].attn.out_proj.weight.std().item() - 0.02) < 0.002


def test_post_norm_and_no_final_norm_build_and_train():
    model = build_model(load_spec_dict(tiny_spec(norm_placement="post", final_norm=False)))
    assert isinstance(model.norm_f, nn.Identity)
    idx = torch.randint(0, 64, (2, 8))
    model(idx, idx).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


class ReportingOptions(ComponentOptions):
    coef: float = 0.5


class ReportingFFN(nn.Module, SideOutputs):
    """An ffn that reports an auxiliary loss and a metric."""

    Options = ReportingOptions

    def __init__(self, options, ctx):
        super().__init__()
        self.coef = options.coef
        self.lin = nn.Linear(ctx.d_model, ctx.d_model)

    def forward(self, x):
        y = self.lin(x)
        self.report_loss("penalty", self.coef * y.pow(2).mean())
        self.report_metric("mean", y.mean().item())
        return y


class Reporting:
    distribution = "llmkit-report"
    name = "report"

    @hookimpl
    def register_components(self, register):
        register("ffn", "reporting", ReportingFFN)


def test_side_outputs_reach_the_model_output_generically():
    reg = registry_with(Reporting())
    spec = tiny_spec(ffn={"name": "reporting", "coef": 2.0})
    spec["model"]["overrides"] = [{"layers": [0], "ffn": {"name": "mlp"}}]
    model = build_model(load_spec_dict(spec, registry=reg))
    idx = torch.randint(0, 64, (2, 8))
    out = model(idx, idx)
    assert set(out.aux_losses) == {"layers.1.ffn.penalty"}
    assert set(out.metrics) == {"layers.1.ffn.mean"}
    total = out.loss + out.aux_losses["layers.1.ffn.penalty"]
    assert torch.equal(out.total_loss, total)
    out2 = model(idx)  # outputs are per forward, not accumulated
    assert set(out2.aux_losses) == {"layers.1.ffn.penalty"}


def test_kv_cache_decoding_matches_the_full_forward():
    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec(position={"name": "rope"}))).eval()
    idx = torch.randint(0, 64, (2, 12))
    full = model(idx).logits
    cache = model.new_cache()
    steps = [model(idx[:, :5], cache=cache).logits]
    for t in range(5, 12):
        steps.append(model(idx[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-4)


def test_sliding_window_cache_keeps_only_the_window():
    model = build_model(
        load_spec_dict(
            tiny_spec(attention={"name": "sliding_window", "window": 4}, position={"name": "rope"})
        )
    ).eval()
    idx = torch.randint(0, 64, (1, 20))
    full = model(idx).logits
    cache = model.new_cache()
    outs = [model(idx[:, t : t + 1], cache=cache).logits for t in range(20)]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-4)
    assert all(layer.length == 4 for layer in cache.layers)


def test_memory_estimate_grows_with_batch():
    model = meta_model(SPECS / "gpt2-small.toml")
    small, big = model.training_memory(1, 1024), model.training_memory(8, 1024)
    assert small["weights"] == 124_439_808 * 4
    assert big["activations"] > 7 * small["activations"]
    assert big["total"] == sum(v for k, v in big.items() if k != "total")
