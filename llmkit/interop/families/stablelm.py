"""The StableLM family (StableLM-3B-4E1T, StableLM 2, StableCode): LayerNorm with a bias,
partial rotary attention (GQA, q/k/v biases with ``use_qkv_bias``, no output bias), a gated
MLP without biases, and a pre-norm block or, with ``use_parallel_residual``, a parallel block
whose one norm feeds both branches.

transformers names: ``model.embed_tokens``, ``model.layers.{i}.input_layernorm``,
``.self_attn.{q,k,v,o}_proj``, ``.post_attention_layernorm`` (sequential blocks only),
``.mlp.{gate,up,down}_proj``, ``model.norm``, ``lm_head``. The MLP gates with ``hidden_act``:
SiLU is llmkit's SwiGLU, GELU its GeGLU. ``qk_layernorm`` (one LayerNorm per query and key
head, each with its own weight) is refused: llmkit's only q/k transform is an RMSNorm shared
by the heads.
"""

from __future__ import annotations

from typing import Any, ClassVar

from llmkit.interop.family import (
    Family,
    Refused,
    dimensions,
    hf_dimensions,
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
from llmkit.interop.mapping import Rule, gated_mlp, same, separate_qkv
from llmkit.spec import ResolvedSpec

#: HF hidden_act → llmkit's gated MLP.
GATED = {
    "silu": {"name": "swiglu"},
    "swish": {"name": "swiglu"},
    "gelu": {"name": "geglu", "approximate": "none"},
    "gelu_new": {"name": "geglu", "approximate": "tanh"},
    "gelu_pytorch_tanh": {"name": "geglu", "approximate": "tanh"},
    "gelu_fast": {"name": "geglu", "approximate": "tanh"},
}


class StableLm(Family):
    priority = 30
    architectures: ClassVar[dict[str, str]] = {"stablelm": "StableLmForCausalLM"}

    # -- import -----------------------------------------------------------------------------
    def spec(self, cfg: dict[str, Any]) -> dict[str, Any]:
        if cfg.get("qk_layernorm"):
            raise Refused(
                "config qk_layernorm=True: a LayerNorm per query and key head, each with its "
                "own weight, has no llmkit equivalent (llmkit's q/k transform is one RMSNorm)"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in GATED:
            raise Refused(f"hidden_act {act!r}: llmkit's gated MLPs use SiLU or GELU")
        d, heads = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
        if d % heads:
            raise Refused(f"hidden_size {d} is not a multiple of num_attention_heads {heads}")
        head_dim = d // heads
        parallel = bool(cfg.get("use_parallel_residual", False))
        model = {
            **dimensions(cfg, 4096),
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "final_norm": True,
            "block": {"name": "parallel", "shared_norm": True}
            if parallel
            else {"name": "pre_norm"},
            "norm": {"name": "layernorm", "eps": cfg.get("layer_norm_eps", 1e-5), "bias": True},
            "position": rope_position(cfg, head_dim, 0.25),
            "attention": {"name": "sdpa"},
            "ffn": GATED[act] | {"hidden": need(cfg, "intermediate_size")},
        }
        return biases(model, False, qkv=bool(cfg.get("use_qkv_bias", False)))

    def rules(self, cfg: dict[str, Any]) -> list[Rule]:
        m = self.spec(cfg)
        H, Hkv, D = m["n_heads"], m["n_kv_heads"], m["head_dim"]
        sizes = [H * D, Hkv * D, Hkv * D]
        parallel = m["block"]["name"] == "parallel"
        out = [same("tok_emb.weight", "model.embed_tokens.weight")]
        for i in range(m["n_layers"]):
            hf, us = f"model.layers.{i}.", f"layers.{i}."
            a = hf + "self_attn."
            out += layernorm_rules(us + "norm1", hf + "input_layernorm")
            if not parallel:
                out += layernorm_rules(us + "norm2", hf + "post_attention_layernorm")
            out += separate_qkv(us + "attn.qkv", a, sizes, bias=m.get("qkv_bias", False))
            out += linear_rules(us + "attn.out_proj", a + "o_proj", False)
            out += gated_mlp(us + "ffn.", hf + "mlp.", bias=False)
        out += layernorm_rules("norm_f", "model.norm")
        if not m["tie_embeddings"]:
            out.append(same("lm_head.weight", "lm_head.weight"))
        return out

    # -- export -----------------------------------------------------------------------------
    def hf_config(self, rs: ResolvedSpec) -> dict[str, Any]:
        m = rs.model
        block, block_opts = block_kind(rs)
        if block == "parallel":
            if not block_opts.get("shared_norm", True):
                raise Refused("parallel block with two norms: StableLM's parallel block has one")
            parallel = True
        elif block == "pre_norm":
            parallel = False
        else:
            raise Refused(f"block {block!r}: StableLM has pre-norm or parallel blocks")
        eps = layernorm_eps(rs)
        ffn, ffn_opts = same_in_every_layer(rs, "ffn")
        if ffn == "swiglu":
            act = "silu"
        elif ffn == "geglu":
            act = "gelu" if ffn_opts["approximate"] == "none" else "gelu_pytorch_tanh"
        else:
            raise Refused(f"ffn {ffn!r}: StableLM has a gated MLP (SwiGLU or GeGLU)")
        if effective(rs, ffn_opts.get("bias")):
            raise Refused("a gated MLP with biases: StableLM's MLP has none")
        qkv_bias, out_bias = attention_biases(rs)
        if out_bias:
            raise Refused("a bias on the attention output: StableLM's o_proj has none")
        if m.head_bias:
            raise Refused("head_bias: StableLM's output head has no bias")
        if m.dim_head * m.n_heads != m.d_model:
            raise Refused(f"head_dim={m.dim_head}: StableLM's heads split d_model evenly")
        plain_attention(rs, "StableLM")
        return {
            "model_type": "stablelm",
            **hf_dimensions(rs),
            "intermediate_size": ffn_hidden_size(rs, ffn_opts),
            "hidden_act": act,
            "layer_norm_eps": eps,
            "use_qkv_bias": qkv_bias,
            "use_parallel_residual": parallel,
            "qk_layernorm": False,
            **hf_rope_exact(rs),
        }


FAMILY = StableLm()
