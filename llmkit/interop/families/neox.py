"""The GPT-NeoX family (Pythia, GPT-NeoX-20B, RedPajama-INCITE): LayerNorm with a bias,
partial rotary embeddings, a GELU MLP with biases, and a parallel block with two norms
(``use_parallel_residual``, the default) or a pre-norm block.

transformers names: ``gpt_neox.embed_in``, ``gpt_neox.layers.{i}.input_layernorm``,
``.attention.query_key_value`` (one fused projection whose rows go head by head, q, k and v of
head 0, then of head 1, …: transformers views its output as (heads, 3·head_size) and chunks
the last dimension), ``.attention.dense``, ``.post_attention_layernorm``,
``.mlp.dense_h_to_4h``, ``.mlp.dense_4h_to_h``, ``gpt_neox.final_layer_norm`` and
``embed_out`` (the name on disk; transformers 5 calls the module ``lm_head``). No GQA: keys
and values have as many heads as queries.

The helpers it shares with the other LayerNorm families, Phi, StableLM and Starcoder2
(rotary defaults, the LayerNorm and bias checks), are in :mod:`llmkit.interop.family_common`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from llmkit.interop.family import (
    Family,
    Refused,
    activation,
    hf_activation,
    need,
    same_in_every_layer,
)
from llmkit.interop.family_common import (
    attention_biases,
    biases,
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
from llmkit.interop.mapping import Rule, mapped, same
from llmkit.spec import ResolvedSpec

# -- GPT-NeoX ---------------------------------------------------------------------------------


def _fused_qkv(ours: str, theirs: str, heads: int) -> Rule:
    """NeoX's fused rows, head by head (q, k, v of head 0, then of head 1, …), to llmkit's
    (every q head, then every k head, then every v head) and back."""

    def grouped(t: Tensor) -> Tensor:
        return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    def per_head(t: Tensor) -> Tensor:
        return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    return mapped(ours, theirs, grouped, per_head)


class GPTNeoX(Family):
    priority = 20
    prefix = "gpt_neox."
    architectures: ClassVar[dict[str, str]] = {"gpt_neox": "GPTNeoXForCausalLM"}
    ignore = ("*.rotary_emb.inv_freq", "*.attention.bias", "*.attention.masked_bias")

    # -- import -----------------------------------------------------------------------------
    def spec(self, cfg: dict[str, Any]) -> dict[str, Any]:
        d, heads = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
        if d % heads:
            raise Refused(f"hidden_size {d} is not a multiple of num_attention_heads {heads}")
        head_dim = d // heads
        attention_bias = bool(cfg.get("attention_bias", True))
        parallel = bool(cfg.get("use_parallel_residual", True))
        model: dict[str, Any] = {
            "vocab_size": need(cfg, "vocab_size"),
            "d_model": d,
            "n_layers": need(cfg, "num_hidden_layers"),
            "n_heads": heads,
            "n_kv_heads": heads,
            "head_dim": head_dim,
            "max_seq_len": cfg.get("max_position_embeddings", 2048),
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "final_norm": True,
            "init_std": cfg.get("initializer_range", 0.02),
            "block": {"name": "parallel", "shared_norm": False}
            if parallel
            else {"name": "pre_norm"},
            "norm": {"name": "layernorm", "eps": cfg.get("layer_norm_eps", 1e-5)},
            "position": rope_position(cfg, head_dim, 0.25, "rotary_emb_base", "rotary_pct"),
            "attention": {"name": "sdpa"},
            "ffn": {
                "name": "mlp",
                "activation": activation(cfg.get("hidden_act", "gelu")),
                "hidden": need(cfg, "intermediate_size"),
            },
        }
        return biases(model, True, qkv=attention_bias, out=attention_bias)

    def rules(self, cfg: dict[str, Any]) -> list[Rule]:
        m = self.spec(cfg)
        H, bias = m["n_heads"], m.get("qkv_bias", True)
        out = [same("tok_emb.weight", "gpt_neox.embed_in.weight")]
        for i in range(m["n_layers"]):
            hf, us = f"gpt_neox.layers.{i}.", f"layers.{i}."
            qkv = hf + "attention.query_key_value"
            out += layernorm_rules(us + "norm1", hf + "input_layernorm")
            out += layernorm_rules(us + "norm2", hf + "post_attention_layernorm")
            out.append(_fused_qkv(us + "attn.qkv.weight", qkv + ".weight", H))
            if bias:
                out.append(_fused_qkv(us + "attn.qkv.bias", qkv + ".bias", H))
            out += linear_rules(us + "attn.out_proj", hf + "attention.dense", bias)
            out += linear_rules(us + "ffn.in_proj", hf + "mlp.dense_h_to_4h", True)
            out += linear_rules(us + "ffn.out_proj", hf + "mlp.dense_4h_to_h", True)
        out += layernorm_rules("norm_f", "gpt_neox.final_layer_norm")
        if not m["tie_embeddings"]:
            out.append(same("lm_head.weight", "embed_out.weight"))
        return out

    # -- export -----------------------------------------------------------------------------
    def hf_config(self, rs: ResolvedSpec) -> dict[str, Any]:
        m = rs.model
        block, block_opts = block_kind(rs)
        if block == "parallel":
            if block_opts.get("shared_norm", True):
                raise Refused("parallel block with one shared norm: GPT-NeoX has two norms")
            parallel = True
        elif block == "pre_norm":
            parallel = False
        else:
            raise Refused(f"block {block!r}: GPT-NeoX has parallel or pre-norm blocks")
        eps = layernorm_eps(rs)
        if m.kv_heads != m.n_heads:
            raise Refused(f"n_kv_heads={m.kv_heads}: GPT-NeoX has no grouped-query attention")
        if m.dim_head * m.n_heads != m.d_model:
            raise Refused(f"head_dim={m.dim_head}: GPT-NeoX's heads split d_model evenly")
        qkv_bias, out_bias = attention_biases(rs)
        if qkv_bias != out_bias:
            raise Refused("GPT-NeoX has biases on both q/k/v and the output projection, or none")
        if m.head_bias:
            raise Refused("head_bias: GPT-NeoX's output head has no bias")
        plain_attention(rs, "GPT-NeoX")
        ffn, ffn_opts = same_in_every_layer(rs, "ffn")
        if ffn != "mlp":
            raise Refused(f"ffn {ffn!r}: GPT-NeoX has a two-layer MLP")
        if not effective(rs, ffn_opts.get("bias")):
            raise Refused("an MLP without biases: GPT-NeoX's MLP has them")
        rope = hf_rope_exact(rs, "rotary_pct")
        return {
            "model_type": "gpt_neox",
            "vocab_size": m.vocab_size,
            "hidden_size": m.d_model,
            "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads,
            "intermediate_size": ffn_hidden_size(rs, ffn_opts),
            "hidden_act": hf_activation(ffn_opts["activation"]),
            "max_position_embeddings": m.max_seq_len,
            "layer_norm_eps": eps,
            "initializer_range": m.init_std,
            "tie_word_embeddings": m.tie_embeddings,
            "use_parallel_residual": parallel,
            "attention_bias": qkv_bias,
            "rotary_emb_base": rope["rope_parameters"]["rope_theta"],
            **rope,
        }


FAMILY = GPTNeoX()
