"""Presets of published models: each has the parameter count transformers gives the same
published config (built here by hand from the model's config.json, on the meta device) and
the figure its model card publishes, and exports as that config; any of them can be
extended; ``llmkit info <preset>`` and ``llmkit list presets``.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from llmkit.cli import main
from llmkit.model import build_on_meta
from llmkit.spec import load_spec, presets
from tests.conftest import SPECS

transformers = pytest.importorskip("transformers")

#: Each preset: its model's config.json (the values that shape the model; HF defaults fill
#: the rest), the published figures (model card, or the Hugging Face hub's count where the
#: card gives none finer), and what transformers' model holds that llmkit's has no place for.
# fmt: off
PUBLISHED: dict[str, dict] = {
    "gpt2": dict(  # openai-community/gpt2; card: 124M
        hf=dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12,
                n_head=12, activation_function="gelu_new"),
        params="124M",
    ),
    "gpt2-medium": dict(  # openai-community/gpt2-medium; card: 355M
        hf=dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=1024,
                n_layer=24, n_head=16, activation_function="gelu_new"),
        params="355M",
    ),
    "opt-125m": dict(  # facebook/opt-125m; card: 125M
        hf=dict(model_type="opt", vocab_size=50272, hidden_size=768, ffn_dim=3072,
                num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=2048,
                word_embed_proj_dim=768, do_layer_norm_before=True, enable_bias=True,
                activation_function="relu", tie_word_embeddings=True),
        params="125M",
        # OPTLearnedPositionalEmbedding keeps 2 rows before position 0 (its offset); no real
        # token reads them and llmkit's table has none (llmkit.interop.families.opt)
        hf_only=2 * 768,
    ),
    "pythia-160m": dict(  # EleutherAI/pythia-160m; README table: 162,322,944 ("160M")
        hf=dict(model_type="gpt_neox", vocab_size=50304, hidden_size=768,
                intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                max_position_embeddings=2048, rotary_pct=0.25, rotary_emb_base=10000,
                use_parallel_residual=True, hidden_act="gelu", layer_norm_eps=1e-5,
                tie_word_embeddings=False),
        params="162M",
    ),
    "phi-2": dict(  # microsoft/phi-2; card: 2.7B, hub: 2.78B
        hf=dict(model_type="phi", vocab_size=51200, hidden_size=2560, intermediate_size=10240,
                num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048,
                partial_rotary_factor=0.4, rope_theta=10000.0, hidden_act="gelu_new",
                layer_norm_eps=1e-5, qk_layernorm=False, tie_word_embeddings=False),
        params="2.78B",
    ),
    "llama-3.2-1b": dict(  # meta-llama/Llama-3.2-1B; card: 1.23B
        hf=dict(model_type="llama", vocab_size=128256, hidden_size=2048,
                intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False, mlp_bias=False,
                rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192),
                tie_word_embeddings=True),
        # Meta's card truncates: 1,235,814,400 is "1.23B" there (the hub rounds it to 1.24B)
        params=("1.23B", "truncated"),
    ),
    "mistral-7b": dict(  # mistralai/Mistral-7B-v0.1; hub: 7.24B
        hf=dict(model_type="mistral", vocab_size=32000, hidden_size=4096,
                intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=32768, sliding_window=4096,
                rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
        params="7.24B",
    ),
    "mixtral-8x7b": dict(  # mistralai/Mixtral-8x7B-v0.1; Mistral AI: 46.7B, 12.9B active
        hf=dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                max_position_embeddings=32768, sliding_window=None, rope_theta=1e6,
                rms_norm_eps=1e-5, tie_word_embeddings=False),
        params="46.7B",
        active="12.9B",
    ),
    "qwen2.5-0.5b": dict(  # Qwen/Qwen2.5-0.5B; card: 0.49B, non-embedding 0.36B
        hf=dict(model_type="qwen2", vocab_size=151936, hidden_size=896,
                intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                rms_norm_eps=1e-6, use_sliding_window=False, tie_word_embeddings=True),
        params="0.49B",
        non_embedding="0.36B",
    ),
    "qwen3-0.6b": dict(  # Qwen/Qwen3-0.6B; card: 0.6B, non-embedding 0.44B
        hf=dict(model_type="qwen3", vocab_size=151936, hidden_size=1024,
                intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1e6, rms_norm_eps=1e-6, attention_bias=False,
                tie_word_embeddings=True),
        params="0.6B",
        non_embedding="0.44B",
    ),
    "starcoder2-3b": dict(  # bigcode/starcoder2-3b; card: 3B
        hf=dict(model_type="starcoder2", vocab_size=49152, hidden_size=3072,
                intermediate_size=12288, num_hidden_layers=30, num_attention_heads=24,
                num_key_value_heads=2, max_position_embeddings=16384, sliding_window=4096,
                rope_theta=999999.4420358813, hidden_act="gelu_pytorch_tanh",
                norm_epsilon=1e-5, use_bias=True, tie_word_embeddings=True),
        params="3B",
    ),
    "mpt-7b": dict(  # mosaicml/mpt-7b; card: 6.7B, hub: 6.65B
        hf=dict(model_type="mpt", vocab_size=50432, d_model=4096, n_heads=32, n_layers=32,
                expansion_ratio=4, max_seq_len=2048, no_bias=True, layer_norm_epsilon=1e-5,
                tie_word_embeddings=True),
        params="6.65B",
    ),
    "gemma-2b": dict(  # google/gemma-2b; hub: 2.51B
        hf=dict(model_type="gemma", vocab_size=256000, hidden_size=2048,
                intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
                num_key_value_heads=1, head_dim=256, max_position_embeddings=8192,
                rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="gelu_pytorch_tanh",
                tie_word_embeddings=True),
        params="2.51B",
    ),
    "gemma-2-2b": dict(  # google/gemma-2-2b; report: 2.6B, hub: 2.61B
        hf=dict(model_type="gemma2", vocab_size=256000, hidden_size=2304,
                intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                sliding_window=4096, attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0, max_position_embeddings=8192,
                rms_norm_eps=1e-6, rope_theta=10000.0,
                hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
        params="2.61B",
    ),
}
# fmt: on

UNITS = {"M": 10**6, "B": 10**9}


def within_published(n: int, figure: str | tuple[str, str]) -> bool:
    """Whether ``n`` is what ``figure`` ("1.23B") says, rounded to its last digit (or
    truncated there, for a figure given as ``(text, "truncated")``)."""
    text, how = (figure, "nearest") if isinstance(figure, str) else figure
    number, unit = re.fullmatch(r"([0-9.]+)([MB])", text).groups()
    decimals = len(number.partition(".")[2])
    step = UNITS[unit] * 10**-decimals  # one unit of the figure's last digit
    value = float(number) * UNITS[unit]
    if how == "truncated":
        return value <= n < value + step
    return abs(n - value) <= step / 2


def info_json(name: str, capsys) -> dict:
    """``llmkit info <name> --json``'s numbers."""
    capsys.readouterr()
    assert main(["info", name, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.rindex("\n{") :])


def hf_counts(config: dict) -> tuple[int, int | None]:
    """Unique parameters (tied ones once) of transformers' model for ``config``, built on
    the meta device; and for a mixture of experts, those active per token (every expert
    block counted at top_k/num_experts)."""
    cfg = copy.deepcopy(config)  # transformers rewrites rope_scaling in place
    cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    unique = {id(p): p.numel() for p in model.parameters()}
    total = sum(unique.values())
    experts = getattr(cfg, "num_local_experts", None)
    if not experts:
        return total, None
    expert_params = sum(
        p.numel()
        for name, mod in model.named_modules()
        if name.endswith(".experts")
        for p in mod.parameters()
    )
    inactive = expert_params * (experts - cfg.num_experts_per_tok) // experts
    return total, total - inactive


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_transformers_and_the_published_count(name, capsys):
    case = PUBLISHED[name]
    ours = info_json(name, capsys)
    total, active = hf_counts(case["hf"])
    assert ours["params"] == total - case.get("hf_only", 0)
    assert within_published(ours["params"], case["params"]), ours["params"]
    if active is not None:
        assert ours["active_params"] == active
    if "active" in case:
        assert within_published(ours["active_params"], case["active"])
    else:
        assert ours["active_params"] == ours["params"]
    if "non_embedding" in case:
        assert within_published(ours["non_embedding_params"], case["non_embedding"])


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_exports_as_the_published_config(name):
    """llmkit's Hugging Face export of the preset (which must import back to the same
    model) is the published config: its model_type and every value given above."""
    from llmkit.interop.convert import hf_config_for

    _, cfg = hf_config_for(load_spec(presets()[name]))
    published = PUBLISHED[name]["hf"]
    assert {k: cfg.get(k) for k in published} == published


def test_every_sized_preset_is_checked():
    """A preset is a family base (no sizes: llama, gemma) or a published model above."""
    bases = {"llama", "gemma"}
    assert set(presets()) == set(PUBLISHED) | bases


def test_gpt2_is_both_the_family_base_and_gpt2_small():
    small = load_spec(SPECS / "gpt2-small.toml").to_dict()["model"]
    assert load_spec(presets()["gpt2"]).to_dict()["model"] == small


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_spec_extends_a_preset_with_overrides(name, tmp_path):
    spec = tmp_path / "small.toml"
    spec.write_text(f'extends = "{name}"\n[model]\nn_layers = 2\nmax_seq_len = 128\n')
    rs = load_spec(spec)
    full = load_spec(presets()[name])
    assert rs.model.n_layers == 2 and rs.model.max_seq_len == 128
    assert rs.model.d_model == full.model.d_model
    assert [p.attention.name for p in rs.layers] == [p.attention.name for p in full.layers[:2]]
    model = build_on_meta(rs)
    assert len(model.layers) == 2 and model.num_params() < build_on_meta(full).num_params()


def test_info_of_an_unknown_name_is_one_line(capsys):
    assert main(["info", "mistral-8b"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "did you mean 'mistral-7b'" in err
    assert "presets: " in err and all(name in err for name in PUBLISHED)


def test_list_presets(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["list", "presets", "qwen*"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-0.5b" in out and "qwen3-0.6b" in out and "gpt2" not in out
