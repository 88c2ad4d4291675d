"""The Starcoder2 family: pre-norm blocks of LayerNorm (always with a bias), rotary GQA
attention with an optional sliding window on every layer, a two-layer MLP (GELU, tanh form),
one ``use_bias`` for every linear layer but the head, and a head tied to the embedding by
default.

transformers names: ``model.embed_tokens``, ``model.layers.{i}.input_layernorm``,
``.self_attn.{q,k,v,o}_proj``, ``.post_attention_layernorm``, ``.mlp.c_fc``, ``.mlp.c_proj``,
``model.norm``, ``lm_head``. ``embedding_dropout`` and ``residual_dropout`` only act in
training. Rotary embeddings turn the whole head (transformers has no partial rotary here).
"""

from __future__ import annotations

from typing import Any, ClassVar

from llmkit.interop import attention_layers as layers_of
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
    with_bias,
)
from llmkit.interop.mapping import Rule, same, separate_qkv
from llmkit.spec import ResolvedSpec


class Starcoder2(Family):
    priority = 40
    architectures: ClassVar[dict[str, str]] = {"starcoder2": "Starcoder2ForCausalLM"}

    # -- import -----------------------------------------------------------------------------
    def spec(self, cfg: dict[str, Any]) -> dict[str, Any]:
        d, heads = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
        head_dim = cfg.get("head_dim") or d // heads
        position = rope_position(cfg, head_dim, 1.0)
        fraction = position.get("rotary_fraction", 1.0)
        if fraction != 1.0:
            raise Refused(f"partial_rotary_factor={fraction}: Starcoder2 rotates the whole head")
        bias = bool(cfg.get("use_bias", True))
        model: dict[str, Any] = {
            **dimensions(cfg, 4096),
            "bias": bias,
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "final_norm": True,
            "block": {"name": "pre_norm"},
            "norm": with_bias(
                {"name": "layernorm", "eps": cfg.get("norm_epsilon", 1e-5)}, bias, True
            ),
            "position": position,
            "ffn": {
                "name": "mlp",
                "activation": activation(cfg.get("hidden_act", "gelu_pytorch_tanh")),
                "hidden": need(cfg, "intermediate_size"),
            },
        }
        layers_of.add_windows(model, cfg)
        return model

    def rules(self, cfg: dict[str, Any]) -> list[Rule]:
        m = self.spec(cfg)
        H, Hkv, D, bias = m["n_heads"], m["n_kv_heads"], m["head_dim"], m["bias"]
        sizes = [H * D, Hkv * D, Hkv * D]
        out = [same("tok_emb.weight", "model.embed_tokens.weight")]
        for i in range(m["n_layers"]):
            hf, us = f"model.layers.{i}.", f"layers.{i}."
            a = hf + "self_attn."
            out += layernorm_rules(us + "norm1", hf + "input_layernorm")
            out += layernorm_rules(us + "norm2", hf + "post_attention_layernorm")
            out += separate_qkv(us + "attn.qkv", a, sizes, bias=bias)
            out += linear_rules(us + "attn.out_proj", a + "o_proj", bias)
            out += linear_rules(us + "ffn.in_proj", hf + "mlp.c_fc", bias)
            out += linear_rules(us + "ffn.out_proj", hf + "mlp.c_proj", bias)
        out += layernorm_rules("norm_f", "model.norm")
        if not m["tie_embeddings"]:
            out.append(same("lm_head.weight", "lm_head.weight"))
        return out

    # -- export -----------------------------------------------------------------------------
    def hf_config(self, rs: ResolvedSpec) -> dict[str, Any]:
        m = rs.model
        block = block_kind(rs)[0]
        if block != "pre_norm":
            raise Refused(f"block {block!r}: Starcoder2 has pre-norm blocks")
        eps = layernorm_eps(rs)
        ffn, ffn_opts = same_in_every_layer(rs, "ffn")
        if ffn != "mlp":
            raise Refused(f"ffn {ffn!r}: Starcoder2 has a two-layer MLP")
        qkv_bias, out_bias = attention_biases(rs)
        ffn_bias = effective(rs, ffn_opts.get("bias"))
        if not qkv_bias == out_bias == ffn_bias:
            raise Refused(
                "Starcoder2 has one use_bias for q/k/v, the output projection and the MLP; "
                f"here they are {qkv_bias}, {out_bias} and {ffn_bias}"
            )
        if m.head_bias:
            raise Refused("head_bias: Starcoder2's output head has no bias")
        plain_attention(rs, "Starcoder2", windows=True)
        rope = hf_rope_exact(rs)
        if rope["partial_rotary_factor"] != 1.0:
            raise Refused("partial rotary: Starcoder2 rotates the whole head")
        return {
            "model_type": "starcoder2",
            **hf_dimensions(rs),
            "intermediate_size": ffn_hidden_size(rs, ffn_opts),
            "hidden_act": hf_activation(ffn_opts["activation"]),
            "norm_epsilon": eps,
            "use_bias": qkv_bias,
            **rope,
            **layers_of.hf_windows(rs, "starcoder2"),
        }


FAMILY = Starcoder2()
