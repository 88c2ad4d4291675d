"""The GPT-2 family (``GPT2LMHeadModel``): learned absolute positions, pre-LN blocks of
LayerNorm with bias, multi-head attention with biases, a two-layer MLP with biases, a final
LayerNorm and a head tied to the embedding (or not, ``tie_word_embeddings``).

transformers names: ``transformer.wte``, ``transformer.wpe``, ``transformer.h.{i}.ln_1``,
``.attn.c_attn`` (q, k and v side by side), ``.attn.c_proj``, ``.ln_2``, ``.mlp.c_fc``,
``.mlp.c_proj``, ``transformer.ln_f``, ``lm_head``. Every linear layer is a ``Conv1D``
whose weight is stored (in, out): transposed against ``nn.Linear``. Older checkpoints also
hold the causal-mask buffers ``.attn.bias`` and ``.attn.masked_bias``: skipped.

Config mapping: ``n_inner`` (default 4·n_embd) is the MLP's hidden size,
``activation_function`` its activation; ``scale_attn_weights=false`` (scores not divided
by √head_dim) is ``attn_scale = 1.0``. ``reorder_and_upcast_attn`` is accepted: it only
changes how transformers' eager path computes the same scores in mixed precision (k
pre-scaled, fp32 softmax), not what the model computes; export writes ``false``.
Refused: ``scale_attn_by_inverse_layer_idx`` (a softmax scale per layer, 1/(i+1), which
llmkit's single ``attn_scale`` cannot hold) and ``add_cross_attention`` (an encoder-decoder
cross-attention llmkit has no module for).

Dropout rates (``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop``) are training settings and
are not carried over (as for every family). The checks it shares with the OPT and MPT
families (what a spec must be to hold "plain" attention, a LayerNorm, an MLP) are in
:mod:`llmkit.interop.family_common`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from llmkit.interop.family import (
    Family,
    Refused,
    activation,
    hf_activation,
    need,
    refuse_set,
    same_in_every_layer,
)
from llmkit.interop.family_common import (
    attention_biases,
    layernorm,
    learned_positions,
    mlp,
    plain_mha,
)
from llmkit.interop.mapping import Rule, same, transposed
from llmkit.spec import ResolvedSpec


def first(cfg: dict[str, Any], *keys: str) -> Any:
    """The first of ``keys`` the config sets (canonical name first, then its alias)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise Refused(f"config.json has no {keys[0]!r}")


class GPT2(Family):
    priority = 5
    prefix = "transformer."
    architectures: ClassVar[dict[str, str]] = {"gpt2": "GPT2LMHeadModel"}
    ignore = ("*.attn.bias", "*.attn.masked_bias")

    # -- import -----------------------------------------------------------------------------
    def spec(self, cfg: dict[str, Any]) -> dict[str, Any]:
        refuse_set(
            cfg,
            scale_attn_by_inverse_layer_idx=lambda v: not v,
            add_cross_attention=lambda v: not v,
        )
        d = first(cfg, "n_embd", "hidden_size")
        heads = first(cfg, "n_head", "num_attention_heads")
        if d % heads:
            raise Refused(f"n_embd {d} is not a multiple of n_head {heads}")
        model: dict[str, Any] = {
            "vocab_size": need(cfg, "vocab_size"),
            "d_model": d,
            "n_layers": first(cfg, "n_layer", "num_hidden_layers"),
            "n_heads": heads,
            "max_seq_len": first(cfg, "n_positions", "max_position_embeddings"),
            "bias": True,
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "final_norm": True,
            "init_std": cfg.get("initializer_range", 0.02),
            "block": {"name": "pre_norm"},
            "norm": {"name": "layernorm", "eps": cfg.get("layer_norm_epsilon", 1e-5)},
            "position": {"name": "learned"},
            "attention": {"name": "sdpa"},
            "ffn": {
                "name": "mlp",
                "activation": activation(cfg.get("activation_function", "gelu_new")),
            },
        }
        if cfg.get("n_inner"):  # unset: 4·n_embd, llmkit's default multiplier
            model["ffn"]["hidden"] = cfg["n_inner"]
        if not cfg.get("scale_attn_weights", True):
            model["attn_scale"] = 1.0
        return model

    def rules(self, cfg: dict[str, Any]) -> list[Rule]:
        m = self.spec(cfg)
        out = [
            same("tok_emb.weight", "transformer.wte.weight"),
            same("position.wpe.weight", "transformer.wpe.weight"),
        ]
        for i in range(m["n_layers"]):
            hf, us = f"transformer.h.{i}.", f"layers.{i}."
            out += [
                same(us + "norm1.weight", hf + "ln_1.weight"),
                same(us + "norm1.bias", hf + "ln_1.bias"),
                transposed(us + "attn.qkv.weight", hf + "attn.c_attn.weight"),
                same(us + "attn.qkv.bias", hf + "attn.c_attn.bias"),
                transposed(us + "attn.out_proj.weight", hf + "attn.c_proj.weight"),
                same(us + "attn.out_proj.bias", hf + "attn.c_proj.bias"),
                same(us + "norm2.weight", hf + "ln_2.weight"),
                same(us + "norm2.bias", hf + "ln_2.bias"),
                transposed(us + "ffn.in_proj.weight", hf + "mlp.c_fc.weight"),
                same(us + "ffn.in_proj.bias", hf + "mlp.c_fc.bias"),
                transposed(us + "ffn.out_proj.weight", hf + "mlp.c_proj.weight"),
                same(us + "ffn.out_proj.bias", hf + "mlp.c_proj.bias"),
            ]
        out += [
            same("norm_f.weight", "transformer.ln_f.weight"),
            same("norm_f.bias", "transformer.ln_f.bias"),
        ]
        if not m["tie_embeddings"]:
            out.append(same("lm_head.weight", "lm_head.weight"))
        return out

    # -- export -----------------------------------------------------------------------------
    def hf_config(self, rs: ResolvedSpec) -> dict[str, Any]:
        m = rs.model
        plain_mha(rs)
        learned_positions(rs)
        if same_in_every_layer(rs, "block")[0] != "pre_norm":
            raise Refused("the block is not pre_norm (GPT-2 normalizes before each sublayer)")
        if not m.final_norm:
            raise Refused("final_norm is off (GPT-2 has a final LayerNorm, ln_f)")
        eps, norm_bias = layernorm(rs)
        act, hidden, mlp_bias = mlp(rs)
        qkv_bias, out_bias = attention_biases(rs)
        biases = {"qkv_bias": qkv_bias, "attn_out_bias": out_bias,
                  "ffn bias": mlp_bias, "norm bias": norm_bias}  # fmt: skip
        missing = [k for k, v in biases.items() if not v]
        if missing:
            raise Refused(f"{missing[0]} is off (GPT-2 has a bias on every linear and norm)")
        if act == "relu":
            raise Refused("a ReLU MLP is OPT's form (exported as OPT)")
        if m.attn_scale not in (None, 1.0):
            raise Refused(
                f"attn_scale {m.attn_scale} (GPT-2 scales scores by 1/sqrt(head_dim), or not "
                "at all with scale_attn_weights=false)"
            )
        return {
            "model_type": "gpt2",
            "vocab_size": m.vocab_size,
            "n_embd": m.d_model,
            "n_layer": m.n_layers,
            "n_head": m.n_heads,
            "n_positions": m.max_seq_len,
            "n_inner": hidden,  # None: 4·n_embd
            "activation_function": "gelu_new" if act == "gelu_tanh" else hf_activation(act),
            "layer_norm_epsilon": eps,
            "initializer_range": m.init_std,
            "scale_attn_weights": m.attn_scale is None,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "add_cross_attention": False,
            "tie_word_embeddings": m.tie_embeddings,
        }


FAMILY = GPT2()
