"""The assembled Transformer: forward, heads, init, post-norm, side outputs, cached decoding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmkit import hookimpl
from llmkit.contracts import ComponentOptions, SideOutputs
from llmkit.model import build_model
from llmkit.spec import load_spec_dict
from tests.helpers import registry_with, tiny_spec


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


@pytest.mark.parametrize("where", ["cpu", "meta"])
def test_build_problems_finds_what_only_building_would(where, monkeypatch):
    import llmkit.model.transformer as transformer

    # A small model is built on the CPU, a large one on the meta device.
    monkeypatch.setattr(transformer, "CHECK_ON_CPU_PARAMS", 10**9 if where == "cpu" else 0)
    devices = []
    real_build = transformer.build_model

    def build(rs):
        devices.append(torch.empty(0).device.type)
        return real_build(rs)

    monkeypatch.setattr(transformer, "build_model", build)
    good = load_spec_dict(tiny_spec(position={"name": "rope"}))
    rng = torch.get_rng_state()
    assert transformer.build_problems(good) == []
    assert devices == [where]
    assert torch.equal(torch.get_rng_state(), rng)  # a check draws no numbers of the run
    odd = load_spec_dict(tiny_spec(position={"name": "rope"}, d_model=36, n_heads=4))  # head 9
    (problem,) = transformer.build_problems(odd)
    assert "rotary dimensions must be a positive even number" in problem


@pytest.mark.parametrize(
    "ffn",
    [
        {"name": "mlp"},
        {"name": "mlp", "multiplier": 3.3, "multiple_of": 16},
        {"name": "swiglu"},
        {"name": "geglu", "bias": False},
        {"name": "moe", "num_experts": 4},
        {
            "name": "moe",
            "num_experts": 4,
            "expert": {"name": "mlp"},
            "shared_experts": 1,
            "shared_expert_gate": True,
            "router_bias": True,
        },
    ],
)
def test_the_one_parameter_estimate_is_close_below_the_built_model(ffn):
    """``estimate_parameters`` (which also chooses how build_problems builds) counts each
    built-in ffn exactly from its options and leaves out only norms, positional tables and
    attention biases."""
    from llmkit.spec import estimate_parameters
    from llmkit.spec.limits import ffn_parameters

    rs = load_spec_dict(tiny_spec(ffn=ffn, vocab_size=1000))
    model = build_model(rs)
    m = rs.model
    estimated = [ffn_parameters(plan.ffn.options, m.d_model, m.bias) for plan in rs.layers]
    assert estimated == [sum(p.numel() for p in layer.ffn.parameters()) for layer in model.layers]
    n = model.num_params()
    assert 0.95 * n < estimate_parameters(rs.spec, rs.layers) <= n


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_build_problems_counts_long_position_tables_and_builds_on_meta(position, monkeypatch):
    """A small model with a huge context: its position table (max_seq_len × d_model, which
    the parameter estimate leaves out) would take gigabytes on the CPU; the check builds it
    on the meta device."""
    import llmkit.model.transformer as transformer

    devices = []
    real_build = transformer.build_model

    def build(rs):
        devices.append(torch.empty(0).device.type)
        return real_build(rs)

    monkeypatch.setattr(transformer, "build_model", build)
    rs = load_spec_dict(tiny_spec(position={"name": position}, max_seq_len=2**20, d_model=1024))
    assert transformer.build_problems(rs) == []
    assert devices == ["meta"]


def test_build_problems_leaves_what_meta_cannot_run_to_the_real_build(monkeypatch):
    import llmkit.model.transformer as transformer

    def meta_lacks_an_op(_rs):
        raise NotImplementedError("aten::some_op has no meta kernel")

    monkeypatch.setattr(transformer, "build_model", meta_lacks_an_op)
    monkeypatch.setattr(transformer, "CHECK_ON_CPU_PARAMS", 0)
    spec = load_spec_dict(tiny_spec(position={"name": "rope"}))
    assert transformer.build_problems(spec) == []  # not a problem of the spec


def test_train_refuses_an_unbuildable_model_before_reading_data(tmp_path, capsys):
    from llmkit.cli import main
    from tests.helpers import write_train_spec

    spec = write_train_spec(tmp_path, "abc " * 100)
    out = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(out), "--set", "model.n_heads=4",
                 "--set", "model.d_model=36"]) == 2  # fmt: skip
    assert "rotary dimensions" in capsys.readouterr().err and not out.exists()
