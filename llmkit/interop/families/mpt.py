"""The MPT family (transformers' ``MptForCausalLM``): ALiBi, pre-LN blocks of LayerNorm
without bias, a fused q/k/v projection, a GELU MLP of 4·d_model, no biases anywhere, a final
LayerNorm and a head tied to the embedding (or not).

transformers names: ``transformer.wte``, ``transformer.blocks.{i}.norm_1``,
``.attn.Wqkv`` (rows: q, k, v), ``.attn.out_proj``, ``.norm_2``, ``.ffn.up_proj``,
``.ffn.down_proj``, ``transformer.norm_f``, ``lm_head``.

The contract is what transformers computes, which is narrower than what an MPT config can
say (MosaicML's own code reads more of it). transformers always builds the model above:
it ignores ``no_bias``, ``expansion_ratio``, ``learned_pos_emb``, ``attn_config.alibi``,
``alibi_bias_max`` (its slopes always use 8), ``qk_ln``, ``prefix_lm``, ``attn_type`` and
``logit_scale``. A config that sets one of these to anything but the value transformers
computes with is refused, naming the setting, since the checkpoint would then mean
different models in the two: ``no_bias=false``, ``expansion_ratio`` other than 4,
``alibi=false`` (a learned-position MPT), ``alibi_bias_max`` other than 8, ``qk_ln``,
``prefix_lm``, ``attn_type`` other than multi-head, ``logit_scale``, ``norm_type`` other
than a LayerNorm. ``clip_qkv`` (which transformers applies: q/k/v clamped to ±c) has no
llmkit equivalent and is refused too. ``learned_pos_emb`` alone is accepted, as
transformers does: with ALiBi no position table is built (a checkpoint that holds
``transformer.wpe`` is refused by name when its tensors are read).

Mapped: ``attn_config.softmax_scale`` is ``attn_scale``; ALiBi with ``max_bias`` 8 (llmkit's
slopes for a head count that is not a power of two are the same sequence as
``build_mpt_alibi_tensor``'s). Accepted as training-only: ``attn_uses_sequence_id`` (masks
attention across packed documents when training with ``token_type_ids``; transformers
ignores it), ``embedding_fraction`` (scales the embedding's gradient only), ``attn_impl``,
``init_device`` and the dropout rates. ``low_precision_layernorm`` is LayerNorm computed in
the autocast dtype: the same in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from llmkit.interop.family import Family, Refused, need, same_in_every_layer
from llmkit.interop.family_common import attention_biases, layernorm, mlp, plain_mha
from llmkit.interop.mapping import Rule, same
from llmkit.spec import ResolvedSpec

#: The ALiBi slope parameter transformers' MptModel always uses.
ALIBI_BIAS_MAX = 8
#: MPT's MLP width, as a multiple of d_model, in transformers.
EXPANSION = 4
NORM_TYPES = ("low_precision_layernorm", "layernorm")
_IGNORED = "transformers' MptForCausalLM ignores it"
#: Config key → (its harmless values, why another value is refused).
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "no_bias": (lambda v: v is True, f"{_IGNORED} and has no biases"),
    "expansion_ratio": (lambda v: v == EXPANSION, f"{_IGNORED} (its MLP is 4·d_model)"),
    "logit_scale": (lambda v: v is None, f"{_IGNORED}; llmkit has no logit scale"),
    "norm_type": (lambda v: v in NORM_TYPES, f"{_IGNORED} (its norms are LayerNorm)"),
    "attn_config.alibi": (
        lambda v: v is True,
        f"{_IGNORED} (it always applies ALiBi, never learned positions)",
    ),
    "attn_config.alibi_bias_max": (
        lambda v: v == ALIBI_BIAS_MAX,
        f"{_IGNORED} (its ALiBi slopes always use {ALIBI_BIAS_MAX})",
    ),
    "attn_config.attn_type": (
        lambda v: v == "multihead_attention",
        f"{_IGNORED} (it has multi-head attention only)",
    ),
    "attn_config.qk_ln": (lambda v: not v, f"{_IGNORED} (no q/k LayerNorm)"),
    "attn_config.prefix_lm": (lambda v: not v, f"{_IGNORED} (causal attention only)"),
    "attn_config.clip_qkv": (lambda v: not v, "q/k/v clamping has no llmkit equivalent"),
}


class MPT(Family):
    priority = 30
    prefix = "transformer."
    architectures: ClassVar[dict[str, str]] = {"mpt": "MptForCausalLM"}
    ignore = ()

    # -- import -----------------------------------------------------------------------------
    def spec(self, cfg: dict[str, Any]) -> dict[str, Any]:
        attn = _attn_config(cfg)
        settings = cfg | {f"attn_config.{k}": v for k, v in attn.items()}
        for key, (harmless, why) in REFUSED.items():
            if key in settings and not harmless(settings[key]):
                raise Refused(f"config {key}={settings[key]!r}: {why}")
        d, heads = need(cfg, "d_model"), need(cfg, "n_heads")
        if d % heads:
            raise Refused(f"d_model {d} is not a multiple of n_heads {heads}")
        model: dict[str, Any] = {
            "vocab_size": need(cfg, "vocab_size"),
            "d_model": d,
            "n_layers": need(cfg, "n_layers"),
            "n_heads": heads,
            "max_seq_len": cfg.get("max_seq_len", 2048),
            "bias": False,
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "final_norm": True,
            "init_std": cfg.get("initializer_range", 0.02),
            "block": {"name": "pre_norm"},
            "norm": {"name": "layernorm", "eps": cfg.get("layer_norm_epsilon", 1e-5)},
            "position": {"name": "alibi", "max_bias": float(ALIBI_BIAS_MAX)},
            "attention": {"name": "sdpa"},
            "ffn": {"name": "mlp", "activation": "gelu"},
        }
        if attn.get("softmax_scale") is not None:
            model["attn_scale"] = attn["softmax_scale"]
        return model

    def rules(self, cfg: dict[str, Any]) -> list[Rule]:
        m = self.spec(cfg)
        out = [same("tok_emb.weight", "transformer.wte.weight")]
        for i in range(m["n_layers"]):
            hf, us = f"transformer.blocks.{i}.", f"layers.{i}."
            out += [
                same(us + "norm1.weight", hf + "norm_1.weight"),
                same(us + "attn.qkv.weight", hf + "attn.Wqkv.weight"),
                same(us + "attn.out_proj.weight", hf + "attn.out_proj.weight"),
                same(us + "norm2.weight", hf + "norm_2.weight"),
                same(us + "ffn.in_proj.weight", hf + "ffn.up_proj.weight"),
                same(us + "ffn.out_proj.weight", hf + "ffn.down_proj.weight"),
            ]
        out.append(same("norm_f.weight", "transformer.norm_f.weight"))
        if not m["tie_embeddings"]:
            out.append(same("lm_head.weight", "lm_head.weight"))
        return out

    # -- export -----------------------------------------------------------------------------
    def hf_config(self, rs: ResolvedSpec) -> dict[str, Any]:
        m = rs.model
        plain_mha(rs)
        name, opts = same_in_every_layer(rs, "position")
        if rs.position.name != "alibi" or name != "alibi":
            raise Refused(f"position {rs.position.name!r} (transformers' MPT has ALiBi only)")
        if opts["max_bias"] != ALIBI_BIAS_MAX:
            raise Refused(
                f"ALiBi max_bias {opts['max_bias']} (transformers' MPT always uses "
                f"alibi_bias_max {ALIBI_BIAS_MAX})"
            )
        if same_in_every_layer(rs, "block")[0] != "pre_norm":
            raise Refused("the block is not pre_norm (MPT normalizes before each sublayer)")
        if not m.final_norm:
            raise Refused("final_norm is off (MPT has a final LayerNorm, norm_f)")
        eps, norm_bias = layernorm(rs)
        act, hidden, mlp_bias = mlp(rs)
        if act != "gelu":
            raise Refused(f"MLP activation {act!r} (MPT's is exact GELU)")
        if hidden not in (None, EXPANSION * m.d_model):
            raise Refused(f"MLP hidden size {hidden} (transformers' MPT has 4·d_model)")
        if any(attention_biases(rs)) or mlp_bias or norm_bias:
            raise Refused("a bias (transformers' MPT has none: no linear or norm biases)")
        return {
            "model_type": "mpt",
            "vocab_size": m.vocab_size,
            "d_model": m.d_model,
            "n_layers": m.n_layers,
            "n_heads": m.n_heads,
            "max_seq_len": m.max_seq_len,
            "expansion_ratio": EXPANSION,
            "no_bias": True,
            "learned_pos_emb": False,
            "layer_norm_epsilon": eps,
            "norm_type": "low_precision_layernorm",
            "initializer_range": m.init_std,
            "tie_word_embeddings": m.tie_embeddings,
            "attn_config": {
                "attn_type": "multihead_attention",
                "alibi": True,
                "alibi_bias_max": ALIBI_BIAS_MAX,
                "softmax_scale": m.attn_scale,
                "clip_qkv": None,
                "qk_ln": False,
                "prefix_lm": False,
                "attn_uses_sequence_id": False,
            },
        }


def _attn_config(cfg: dict[str, Any]) -> dict[str, Any]:
    attn = cfg.get("attn_config") or {}
    if not isinstance(attn, dict):
        raise Refused(f"config attn_config={attn!r} is not a table")
    return attn


FAMILY = MPT()
