"""The Phi family (Phi-1, Phi-1.5, Phi-2): a parallel block with one shared LayerNorm,
partial rotary attention with biases everywhere, a GELU MLP, and an output head with a bias.

transformers names: ``model.embed_tokens``, ``model.layers.{i}.input_layernorm``,
``.self_attn.{q,k,v}_proj``, ``.self_attn.dense``, ``.mlp.fc1``, ``.mlp.fc2``,
``model.final_layernorm``, ``lm_head`` (weight and bias). ``embd_pdrop`` and ``resid_pdrop``
are dropout, which only training uses. ``qk_layernorm`` (a LayerNorm with weight and bias on
each query and key head) is refused: llmkit's only q/k transform is an RMSNorm.
"""

from __future__ import annotations

from typing import Any, ClassVar

from llmkit.interop.family import (
    Family,
    Refused,
    activation,
    dimensions,
    hf_activation,
    hf_dimensions,
    need,
    same_in_every_layer,
)
from llmkit.interop.family_common import (
    attention_biases,
    block_kind,
    effective,
    ffn_hidden_size,
    hf_rope_exact,
    layernorm_eps,
    layernorm_rules,
    linear_rules,
    plain_attention,
    rope_position,
)
from llmkit.interop.mapping import Rule, same, separate_qkv
from llmkit.spec import ResolvedSpec


class Phi(Family):
    priority = 25
    architectures: ClassVar[dict[str, str]] = {"phi": "PhiForCausalLM"}

    # -- import -----------------------------------------------------------------------------
    def spec(self, cfg: dict[str, Any]) -> dict[str, Any]:
        if cfg.get("qk_layernorm"):
            raise Refused(
                "config qk_layernorm=True: a LayerNorm with a bias on each query and key head "
                "has no llmkit equivalent (llmkit's q/k transform is an RMSNorm)"
            )
        d, heads = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
        head_dim = cfg.get("head_dim") or d // heads
        return {
            **dimensions(cfg, 2048),
            "bias": True,
            "head_bias": True,
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "final_norm": True,
            "block": {"name": "parallel", "shared_norm": True},
            "norm": {"name": "layernorm", "eps": cfg.get("layer_norm_eps", 1e-5)},
            "position": rope_position(cfg, head_dim, 0.5),
            "attention": {"name": "sdpa"},
            "ffn": {
                "name": "mlp",
                "activation": activation(cfg.get("hidden_act", "gelu_new")),
                "hidden": need(cfg, "intermediate_size"),
            },
        }

    def rules(self, cfg: dict[str, Any]) -> list[Rule]:
        m = self.spec(cfg)
        H, Hkv, D = m["n_heads"], m["n_kv_heads"], m["head_dim"]
        sizes = [H * D, Hkv * D, Hkv * D]
        out = [same("tok_emb.weight", "model.embed_tokens.weight")]
        for i in range(m["n_layers"]):
            hf, us = f"model.layers.{i}.", f"layers.{i}."
            a = hf + "self_attn."
            out += layernorm_rules(us + "norm1", hf + "input_layernorm")
            out += separate_qkv(us + "attn.qkv", a, sizes, bias=True)
            out += linear_rules(us + "attn.out_proj", a + "dense", True)
            out += linear_rules(us + "ffn.in_proj", hf + "mlp.fc1", True)
            out += linear_rules(us + "ffn.out_proj", hf + "mlp.fc2", True)
        out += layernorm_rules("norm_f", "model.final_layernorm")
        if not m["tie_embeddings"]:
            out.append(same("lm_head.weight", "lm_head.weight"))
        out.append(same("lm_head.bias", "lm_head.bias"))
        return out

    # -- export -----------------------------------------------------------------------------
    def hf_config(self, rs: ResolvedSpec) -> dict[str, Any]:
        m = rs.model
        block, block_opts = block_kind(rs)
        if block != "parallel" or not block_opts.get("shared_norm", True):
            shape = "two norms" if block == "parallel" else f"block {block!r}"
            raise Refused(f"{shape}: Phi has parallel blocks with one shared norm")
        eps = layernorm_eps(rs)
        ffn, ffn_opts = same_in_every_layer(rs, "ffn")
        if ffn != "mlp":
            raise Refused(f"ffn {ffn!r}: Phi has a two-layer MLP")
        if not effective(rs, ffn_opts.get("bias")):
            raise Refused("an MLP without biases: Phi's MLP has them")
        if attention_biases(rs) != (True, True):
            raise Refused("attention without biases: Phi's q/k/v and dense projections have them")
        if not m.head_bias:
            raise Refused("an output head without a bias: Phi's head has one")
        plain_attention(rs, "Phi")
        act = ffn_opts["activation"]
        return {
            "model_type": "phi",
            **hf_dimensions(rs),
            "intermediate_size": ffn_hidden_size(rs, ffn_opts),
            "hidden_act": "gelu_new" if act == "gelu_tanh" else hf_activation(act),
            "layer_norm_eps": eps,
            "qk_layernorm": False,
            **hf_rope_exact(rs),
        }


FAMILY = Phi()
