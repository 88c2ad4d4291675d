"""The Gemma family: Gemma (Gemma Team 2024: √d_model embedding scale, RMSNorm with a unit
offset (1 + w), GeGLU with tanh GELU, MQA in the 2B model, head_dim 256, tied head) and Gemma 2
(sandwich norms around both sublayers, attention and final logit soft-capping, a softmax scale
of query_pre_attn_scalar^-1/2, sliding-window layers alternating with global ones).

transformers names: ``model.embed_tokens``, ``model.layers.{i}.input_layernorm``,
``.self_attn.{q,k,v,o}_proj``, ``.post_attention_layernorm`` (Gemma: before the MLP; Gemma 2:
on the attention's output), ``.pre_feedforward_layernorm`` / ``.post_feedforward_layernorm``
(Gemma 2), ``.mlp.{gate,up,down}_proj``, ``model.norm``; the head is tied by default.
Attention soft-capping needs the ``dense`` kernel (the fused ones cannot cap scores), so a
Gemma 2 model with it runs ``dense`` on every layer, windowed where HF windows.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from llmkit.interop import attention_layers as layers_of
from llmkit.interop.family import (
    Family,
    Refused,
    dimensions,
    hf_dimensions,
    need,
    part,
    same_in_every_layer,
)
from llmkit.interop.mapping import Rule, gated_mlp, qk_norms, same, separate_qkv
from llmkit.interop.rotary import hf_rope, rope_options, rope_parameters_to_hf
from llmkit.spec import ResolvedSpec

#: HF's GELU names → GeGLU's ``approximate``.
GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}
HF_GELU = {"tanh": "gelu_pytorch_tanh", "none": "gelu"}
GEMMA3 = "gemma3_text"


class Gemma(Family):
    priority = 15
    architectures: ClassVar[dict[str, str]] = {
        "gemma": "GemmaForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
    }

    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "gemma": {"head_dim": 256},
        "gemma2": {
            "head_dim": 256,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
        },
        "gemma3_text": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096},
    }

    # -- import -----------------------------------------------------------------------------
    def spec(self, cfg: dict[str, Any]) -> dict[str, Any]:
        mt = cfg["model_type"]
        d, heads = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
        head_dim = cfg.get("head_dim") or d // heads
        act_key = "hidden_act" if mt == "gemma" else "hidden_activation"
        act = cfg.get(act_key) or "gelu_pytorch_tanh"
        if act not in GELU:
            raise Refused(f"{act_key} {act!r}: Gemma's MLP is a GeGLU")
        if mt == "gemma" and act == "gelu":  # transformers reads the released configs' legacy
            act = "gelu_pytorch_tanh"  # "gelu" as the tanh approximation Gemma was trained with
        if cfg.get("use_bidirectional_attention"):
            raise Refused("use_bidirectional_attention: llmkit's models are causal")
        bias = bool(cfg.get("attention_bias", False))
        model: dict[str, Any] = {
            **dimensions(cfg, 8192),
            "bias": False,
            "qkv_bias": bias,
            "attn_out_bias": bias,
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "embedding_scale": "sqrt_d_model",
            "final_norm": True,
            "block": {"name": "pre_norm" if mt == "gemma" else "sandwich"},
            "norm": {"name": "rmsnorm", "eps": cfg.get("rms_norm_eps", 1e-6), "offset": 1.0},
            "position": {} if mt == GEMMA3 else rope_options(cfg, head_dim),
            "ffn": {
                "name": "geglu",
                "hidden": need(cfg, "intermediate_size"),
                "approximate": GELU[act],
                "bias": False,
            },
        }
        if mt != "gemma":
            model["attn_scale"] = float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5
            if cfg.get("final_logit_softcapping"):
                model["logit_softcap"] = float(cfg["final_logit_softcapping"])
        if mt == GEMMA3:
            eps = cfg.get("rms_norm_eps", 1e-6)
            model["qk_transform"] = {"name": "rmsnorm", "eps": eps, "offset": 1.0}
            _gemma3_rope(model, cfg, head_dim)
        cap = cfg.get("attn_logit_softcapping") if mt != "gemma" else None
        if cap:
            windows = layers_of.hf_layer_windows(cfg)
            model["attention"] = {"name": "dense", "softcap": float(cap)}
            for w in sorted({w for w in windows if w is not None}):
                picked = [i for i, x in enumerate(windows) if x == w]
                kernel = {"name": "dense", "softcap": float(cap), "window": w}
                model.setdefault("overrides", []).append({"layers": picked, "attention": kernel})
        else:
            layers_of.add_windows(model, cfg)
        if mt == GEMMA3:  # the sliding layers' own RoPE, in the overrides that window them
            local = model.pop("local_position")
            for override in model.get("overrides", []):
                override["position"] = local
            if "overrides" not in model and model["attention"].get("window"):
                model["position"] = local  # every layer slides: no override says so
        return model

    def rules(self, cfg: dict[str, Any]) -> list[Rule]:
        m = self.spec(cfg)
        H, Hkv, D = m["n_heads"], m["n_kv_heads"], m["head_dim"]
        sizes = [H * D, Hkv * D, Hkv * D]
        out = [same("tok_emb.weight", "model.embed_tokens.weight")]
        if m["block"]["name"] == "pre_norm":
            norms = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm"}
        else:
            norms = {
                "norm1": "input_layernorm",
                "attn_post_norm": "post_attention_layernorm",
                "norm2": "pre_feedforward_layernorm",
                "ffn_post_norm": "post_feedforward_layernorm",
            }
        for i in range(m["n_layers"]):
            hf, us = f"model.layers.{i}.", f"layers.{i}."
            a = hf + "self_attn."
            out += [same(us + f"{k}.weight", hf + f"{v}.weight") for k, v in norms.items()]
            out += [
                *separate_qkv(us + "attn.qkv", a, sizes, bias=m["qkv_bias"]),
                same(us + "attn.out_proj.weight", a + "o_proj.weight"),
                *gated_mlp(us + "ffn.", hf + "mlp.", bias=False),
            ]
            if "qk_transform" in m:
                out += qk_norms(us + "attn.qk_transform.", a)
            if m["qkv_bias"]:
                out.append(same(us + "attn.out_proj.bias", a + "o_proj.bias"))
        out.append(same("norm_f.weight", "model.norm.weight"))
        if not m["tie_embeddings"]:
            out.append(same("lm_head.weight", "lm_head.weight"))
        return out

    # -- export -----------------------------------------------------------------------------
    def hf_config(self, rs: ResolvedSpec) -> dict[str, Any]:
        m = rs.model
        scale = m.embedding_scale
        if scale != "sqrt_d_model" and not math.isclose(float(scale), math.sqrt(m.d_model)):
            raise Refused("no √d_model embedding scale")
        block, block_opts = same_in_every_layer(rs, "block")
        if block == "pre_norm":
            mt = "gemma"
        elif block == "sandwich" and block_opts.get("input_norms", True):
            mt = "gemma2"
        else:
            raise Refused(f"block {block!r}: Gemma is pre_norm, Gemma 2 sandwich")
        norm, norm_opts = same_in_every_layer(rs, "norm")
        if norm != "rmsnorm" or norm_opts.get("offset") != 1.0:
            raise Refused("norm: Gemma's is an RMSNorm with gain 1 + w (offset 1)")
        qk, qk_opts = same_in_every_layer(rs, "qk_transform")
        if qk:
            if mt != "gemma2" or qk != "rmsnorm" or qk_opts["offset"] != 1.0:
                raise Refused("a qk_transform: Gemma 3's is an RMSNorm with gain 1 + w")
            if qk_opts["eps"] != norm_opts["eps"]:
                raise Refused("the q/k norms' eps differs from the norms'")
            mt = GEMMA3
        ffn, ffn_opts = same_in_every_layer(rs, "ffn")
        if ffn != "geglu":
            raise Refused(f"ffn {ffn!r}: Gemma's MLP is a GeGLU")
        qkv_bias = m.bias if m.qkv_bias is None else m.qkv_bias
        from llmkit.contracts import ffn_hidden

        hidden = ffn_hidden(
            m.d_model, ffn_opts.get("hidden"), ffn_opts["multiplier"], ffn_opts["multiple_of"]
        )
        cfg: dict[str, Any] = {
            "model_type": mt,
            **hf_dimensions(rs),
            "intermediate_size": hidden,
            "rms_norm_eps": norm_opts["eps"],
            "attention_bias": bool(qkv_bias),
            ("hidden_act" if mt == "gemma" else "hidden_activation"): HF_GELU[
                ffn_opts["approximate"]
            ],
            **(_hf_gemma3_rope(rs) if mt == GEMMA3 else hf_rope(rs)),
        }
        caps = {part(rs, "attention", j)[1].get("softcap") for j in range(m.n_layers)}
        if mt == "gemma" and ffn_opts["approximate"] != "tanh":
            raise Refused("exact GELU: transformers' Gemma reads hidden_act 'gelu' as tanh GELU")
        if mt == "gemma":
            if m.attn_scale is not None or m.logit_softcap is not None or caps != {None}:
                raise Refused("a softmax scale or soft-capping: Gemma has neither (Gemma 2 has)")
            cfg.update(layers_of.hf_windows(rs, mt))
            return cfg
        if len(caps) > 1:
            raise Refused("attention soft-capping differs between layers")
        cfg.update(
            query_pre_attn_scalar=_integral((m.attn_scale or m.dim_head**-0.5) ** -2),
            final_logit_softcapping=m.logit_softcap,
            attn_logit_softcapping=caps.pop(),
        )
        cfg.update(layers_of.hf_windows(rs, mt))
        return cfg


def _gemma3_rope(model: dict[str, Any], cfg: dict[str, Any], head_dim: int) -> None:
    """Gemma 3's two RoPEs: ``full_attention`` layers' (θ 1e6, maybe scaled) as the model's
    position, ``sliding_attention`` layers' (θ 1e4) as ``local_position`` for their overrides.
    transformers 5 keeps them in ``rope_parameters`` by layer type; older configs have
    ``rope_theta`` + ``rope_scaling`` and ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    if not params:
        full |= cfg.get("rope_scaling") or {}
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    for name, table in (("position", full), ("local_position", local)):
        model[name] = rope_options(
            {"rope_parameters": table, "max_position_embeddings": model["max_seq_len"]}, head_dim
        )


def _hf_gemma3_rope(rs: ResolvedSpec) -> dict[str, Any]:
    """``rope_parameters`` by layer type, each the same in all layers of its type."""
    by_type: dict[str, dict[str, Any]] = {}
    for j, w in enumerate(layers_of.windows(rs)):
        kind = "sliding_attention" if w else "full_attention"
        name, opts = part(rs, "position", j)
        if name != "rope" or opts.get("pairing", "half") != "half":
            raise Refused(f"position {name!r} in layer {j}: Gemma 3 rotates halves with RoPE")
        if by_type.setdefault(kind, opts) != opts:
            raise Refused(f"the {kind} layers' RoPE differs between layers")
    by_type.setdefault("sliding_attention", {"theta": 10_000.0})
    by_type.setdefault("full_attention", {"theta": 1_000_000.0})
    return {"rope_parameters": {k: rope_parameters_to_hf(v) for k, v in by_type.items()}}


def _integral(x: float) -> float | int:
    return round(x) if math.isclose(x, round(x), rel_tol=1e-12) else x


FAMILY = Gemma()
