"""The Llama family: Llama (GQA/MQA, explicit head_dim, tied or untied embeddings, attention
and MLP biases), Mistral (sliding window), Mixtral (top-2 MoE), Qwen2 (q/k/v bias without an
output bias), Qwen2-MoE (a sigmoid-gated shared expert), Qwen3 (q/k RMSNorm before RoPE) and
Qwen3-MoE (top-k of a softmax over all experts, renormalized only with norm_topk_prob).

Shared shape: token embedding, pre-norm blocks of RMSNorm, rotary attention and a SwiGLU (or
SwiGLU-expert MoE) MLP, a final RMSNorm, and a head. transformers names:
``model.embed_tokens``, ``model.layers.{i}.input_layernorm``, ``.self_attn.{q,k,v,o}_proj``,
``.self_attn.{q,k}_norm``, ``.post_attention_layernorm``, ``.mlp.{gate,up,down}_proj`` (MoE:
``.block_sparse_moe.gate`` and ``.experts.{e}.w1/w3/w2`` in Mixtral; ``.mlp.gate`` and
``.mlp.experts.{e}.{gate,up,down}_proj`` in Qwen2/Qwen3-MoE, with ``.mlp.shared_expert`` and
its sigmoid ``.mlp.shared_expert_gate`` in Qwen2-MoE), ``model.norm``, ``lm_head``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from llmkit.interop import attention_layers as layers_of
from llmkit.interop.family import (
    Family,
    Refused,
    activation,
    dimensions,
    hf_dimensions,
    need,
    part,
    refuse_set,
    same_in_every_layer,
)
from llmkit.interop.family_common import attention_biases, effective
from llmkit.interop.mapping import Rule, experts, gated_mlp, qk_norms, same, separate_qkv
from llmkit.interop.rotary import hf_rope, rope_options
from llmkit.spec import ResolvedSpec

MOE = ("mixtral", "qwen3_moe", "qwen2_moe")
QWEN_MOE = ("qwen3_moe", "qwen2_moe")
QK_NORM = ("qwen3", "qwen3_moe")
QKV_BIAS = ("qwen2", "qwen2_moe")
#: The model types whose transformers attention reads ``attention_bias`` (q, k, v and o), and
#: the one whose MLP reads ``mlp_bias``: the others' layers have no such bias whatever their
#: config says, so import ignores the key there and export refuses a bias they cannot hold.
ATTENTION_BIAS = ("llama", "qwen3", "qwen3_moe")
MLP_BIAS = ("llama",)
#: tie_word_embeddings when a config leaves it out (the config classes' defaults).
TIED_DEFAULT = {"llama": False, "mistral": False, "mixtral": False, "qwen2": False,
                "qwen3": False, "qwen3_moe": False, "qwen2_moe": False}  # fmt: skip


class Llama(Family):
    priority = 10
    architectures: ClassVar[dict[str, str]] = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
    }

    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6},
        "mistral": {"sliding_window": 4096},
    }

    # -- import -----------------------------------------------------------------------------
    def spec(self, cfg: dict[str, Any]) -> dict[str, Any]:
        mt = cfg["model_type"]
        d, heads = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
        head_dim = cfg.get("head_dim") or d // heads
        refuse_set(cfg, pretraining_tp=lambda v: v in (None, 1))
        eps = cfg.get("rms_norm_eps", 1e-6)
        attention_bias = mt in ATTENTION_BIAS and bool(cfg.get("attention_bias", False))
        model: dict[str, Any] = {
            **dimensions(cfg, 2048),
            "bias": False,
            "qkv_bias": bool(cfg.get("qkv_bias", True)) if mt in QKV_BIAS else attention_bias,
            "attn_out_bias": False if mt in QKV_BIAS else attention_bias,
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", TIED_DEFAULT[mt])),
            "final_norm": True,
            "block": {"name": "pre_norm"},
            "norm": {"name": "rmsnorm", "eps": eps},
            "position": rope_options(cfg, head_dim),
            "ffn": self._ffn(cfg),
        }
        if mt in QK_NORM:
            model["qk_transform"] = {"name": "rmsnorm", "eps": eps}
        layers_of.add_windows(model, cfg)
        if mt in QWEN_MOE:
            dense = _qwen_dense_layers(cfg)
            if dense:
                model.setdefault("overrides", []).append(
                    {"layers": dense, "ffn": _swiglu(cfg, cfg.get("intermediate_size"))}
                )
        return model

    def _ffn(self, cfg: dict[str, Any]) -> dict[str, Any]:
        mt = cfg["model_type"]
        act = activation(cfg.get("hidden_act", "silu"))
        if act != "silu":
            raise Refused(f"hidden_act {cfg.get('hidden_act')!r}: a gated MLP with SiLU only")
        if mt == "mixtral":
            refuse_set(cfg, router_jitter_noise=lambda v: not v)
            return {
                "name": "moe",
                "num_experts": need(cfg, "num_local_experts"),
                "top_k": need(cfg, "num_experts_per_tok"),
                "routing": "topk_softmax",
                "expert": {"name": "swiglu", "hidden": need(cfg, "intermediate_size")},
                "load_balance_coef": cfg.get("router_aux_loss_coef", 0.02),
            }
        if mt in QWEN_MOE:
            moe = {
                "name": "moe",
                "num_experts": _n_experts(cfg),
                "top_k": need(cfg, "num_experts_per_tok"),
                "routing": "softmax_topk",
                "renormalize": bool(cfg.get("norm_topk_prob", False)),
                "expert": {"name": "swiglu", "hidden": need(cfg, "moe_intermediate_size")},
                "load_balance_coef": cfg.get("router_aux_loss_coef", 0.001),
            }
            shared = cfg.get("shared_expert_intermediate_size") if mt == "qwen2_moe" else 0
            if shared:
                moe |= {"shared_experts": 1, "shared_hidden": shared, "shared_expert_gate": True}
            return moe
        return _swiglu(cfg, need(cfg, "intermediate_size"))

    def rules(self, cfg: dict[str, Any]) -> list[Rule]:
        m = self.spec(cfg)
        H, Hkv, D = m["n_heads"], m["n_kv_heads"], m["head_dim"]
        mt = cfg["model_type"]
        out = [same("tok_emb.weight", "model.embed_tokens.weight")]
        dense = set(_qwen_dense_layers(cfg)) if mt in QWEN_MOE else set()
        for i in range(m["n_layers"]):
            hf, us = f"model.layers.{i}.", f"layers.{i}."
            a = hf + "self_attn."
            out += [
                same(us + "norm1.weight", hf + "input_layernorm.weight"),
                same(us + "norm2.weight", hf + "post_attention_layernorm.weight"),
                same(us + "attn.out_proj.weight", a + "o_proj.weight"),
                *separate_qkv(us + "attn.qkv", a, [H * D, Hkv * D, Hkv * D], bias=m["qkv_bias"]),
            ]
            if m["attn_out_bias"]:
                out.append(same(us + "attn.out_proj.bias", a + "o_proj.bias"))
            if mt in QK_NORM:
                out += qk_norms(us + "attn.qk_transform.", a)
            if mt in MOE and i not in dense:
                out += _moe_rules(cfg, hf, us)
            else:
                out += gated_mlp(us + "ffn.", hf + "mlp.", bias=_mlp_bias(cfg))
        out.append(same("norm_f.weight", "model.norm.weight"))
        if not m["tie_embeddings"]:
            out.append(same("lm_head.weight", "lm_head.weight"))
        return out

    # -- export -----------------------------------------------------------------------------
    def hf_config(self, rs: ResolvedSpec) -> dict[str, Any]:
        m = rs.model
        if same_in_every_layer(rs, "block")[0] != "pre_norm":
            raise Refused("the block is not pre_norm")
        norm, norm_opts = same_in_every_layer(rs, "norm")
        if norm != "rmsnorm" or norm_opts.get("offset"):
            raise Refused(f"norm {norm!r} is not an RMSNorm with gain w")
        qk, qk_opts = same_in_every_layer(rs, "qk_transform")
        ffns = [part(rs, "ffn", j) for j in range(m.n_layers)]
        ffn, ffn_opts = next((f for f in ffns if f[0] == "moe"), ffns[0])
        qkv_bias, out_bias = attention_biases(rs)
        moe = ffn == "moe"
        if moe and ffn_opts.get("routing") == "softmax_topk":
            mt = "qwen3_moe" if qk else "qwen2_moe"
        elif moe:
            mt = "mixtral"
        elif qk:
            mt = "qwen3"
        elif qkv_bias and not out_bias:
            mt = "qwen2"
        elif any(w is not None for w in layers_of.windows(rs)):
            mt = "mistral"
        else:
            mt = "llama"
        cfg: dict[str, Any] = {
            "model_type": mt,
            **hf_dimensions(rs),
            "rms_norm_eps": norm_opts["eps"],
            "hidden_act": "silu",
            **hf_rope(rs),
        }
        if (qkv_bias or out_bias) and mt not in ATTENTION_BIAS + QKV_BIAS:
            raise Refused(f"attention biases: transformers' {mt} attention (chosen for the "
                          "model's window or experts) has none")  # fmt: skip
        if mt in QKV_BIAS and out_bias:
            raise Refused(f"an attention output bias: {mt} has q, k, v biases only")
        if mt in ATTENTION_BIAS:
            cfg["attention_bias"] = bool(qkv_bias)
        elif mt == "qwen2_moe":
            cfg["qkv_bias"] = bool(qkv_bias)
        if mt in QK_NORM and qk_opts.get("offset"):
            raise Refused("qk_transform rmsnorm with a gain offset (Gemma 3's form)")
        if moe:
            e = ffn_opts["expert"]
            if e["name"] != "swiglu":
                raise Refused(f"MoE experts {e['name']!r}: this family has SwiGLU experts")
            if effective(rs, e.get("bias")):
                raise Refused(f"MoE experts with biases: {mt} experts have none")
            cfg.update(
                num_experts_per_tok=ffn_opts["top_k"],
                router_aux_loss_coef=ffn_opts.get("load_balance_coef", 0.0),
            )
            hidden = _hidden(rs, e)
            if mt == "mixtral":
                cfg.update(num_local_experts=ffn_opts["num_experts"], intermediate_size=hidden)
            else:
                dense = [j for j in range(m.n_layers) if part(rs, "ffn", j)[0] != "moe"]
                dense_hidden = _hidden(rs, part(rs, "ffn", dense[0])[1]) if dense else hidden
                cfg.update(
                    num_experts=ffn_opts["num_experts"],
                    moe_intermediate_size=hidden,
                    intermediate_size=dense_hidden,
                    norm_topk_prob=bool(ffn_opts.get("renormalize")),
                    decoder_sparse_step=1,
                    mlp_only_layers=dense,
                )
                if mt == "qwen2_moe":
                    n_shared = ffn_opts["shared_experts"]
                    width = ffn_opts["shared_hidden"] or n_shared * hidden
                    cfg["shared_expert_intermediate_size"] = width if n_shared else 0
        else:
            if ffn != "swiglu":
                raise Refused(f"ffn {ffn!r}: this family has a SwiGLU MLP")
            cfg["intermediate_size"] = _hidden(rs, ffn_opts)
            mlp_bias = effective(rs, ffn_opts.get("bias"))
            if mlp_bias and mt not in MLP_BIAS:
                raise Refused(f"an MLP bias: transformers' {mt} MLP (chosen for the model's "
                              "window, q/k norm or q/k/v biases) has none")  # fmt: skip
            if mt in MLP_BIAS:
                cfg["mlp_bias"] = mlp_bias
        cfg.update(layers_of.hf_windows(rs, mt))
        return cfg


def _hidden(rs: ResolvedSpec, opts: dict[str, Any]) -> int:
    from llmkit.contracts import ffn_hidden

    return ffn_hidden(rs.model.d_model, opts.get("hidden"), opts["multiplier"], opts["multiple_of"])


def _swiglu(cfg: dict[str, Any], hidden: int | None) -> dict[str, Any]:
    if not hidden:
        raise Refused("config.json has no 'intermediate_size'")
    return {"name": "swiglu", "hidden": hidden, "bias": _mlp_bias(cfg)}


def _mlp_bias(cfg: dict[str, Any]) -> bool:
    return cfg["model_type"] in MLP_BIAS and bool(cfg.get("mlp_bias", False))


def _qwen_dense_layers(cfg: dict[str, Any]) -> list[int]:
    """Layers of a Qwen2/Qwen3-MoE model with a dense MLP (``mlp_only_layers``, and every layer
    whose index + 1 is not a multiple of ``decoder_sparse_step``)."""
    n, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step", 1) or 1
    only = set(cfg.get("mlp_only_layers") or [])
    n_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    return [i for i in range(n) if i in only or not (n_experts > 0 and (i + 1) % step == 0)]


def _moe_rules(cfg: dict[str, Any], hf: str, us: str) -> list[Rule]:
    if cfg["model_type"] == "mixtral":
        moe, E, h = hf + "block_sparse_moe.", cfg["num_local_experts"], cfg["intermediate_size"]
        gate, up, down = "w1", "w3", "w2"
        router = moe + "gate.weight"
    else:
        moe, E, h = hf + "mlp.", _n_experts(cfg), cfg["moe_intermediate_size"]
        gate, up, down = "gate_proj", "up_proj", "down_proj"
        router = moe + "gate.weight"
    x = moe + "experts.{e}."
    shared = []
    if cfg["model_type"] == "qwen2_moe" and cfg.get("shared_expert_intermediate_size"):
        shared = gated_mlp(us + "ffn.shared.", moe + "shared_expert.", bias=False)
        shared.append(same(us + "ffn.shared_gate.weight", moe + "shared_expert_gate.weight"))
    return [
        *shared,
        same(us + "ffn.router.weight", router),
        experts(
            us + "ffn.w_in",
            [[x.format(e=e) + f"{gate}.weight", x.format(e=e) + f"{up}.weight"] for e in range(E)],
            [h, h],
        ),
        experts(
            us + "ffn.w_out",
            [[x.format(e=e) + f"{down}.weight"] for e in range(E)],
            [cfg["hidden_size"]],
        ),
    ]


def _n_experts(cfg: dict[str, Any]) -> int:
    """Routed experts of a Qwen MoE config (transformers 5 also writes num_local_experts)."""
    n = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not n:
        raise Refused("config.json has no 'num_experts'")
    return int(n)


FAMILY = Llama()
