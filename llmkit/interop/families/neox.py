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

The helpers below (rotary defaults, the LayerNorm and bias checks) are shared with the other
LayerNorm families: Phi, StableLM and Starcoder2.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from llmkit.interop import attention_layers as layers_of
from llmkit.interop.family import (
    Family,
    Refused,
    activation,
    hf_activation,
    need,
    same_in_every_layer,
)
from llmkit.interop.mapping import Rule, mapped, same
from llmkit.interop.rotary import hf_rope, rope_options
from llmkit.spec import ResolvedSpec

# -- helpers shared by the LayerNorm families -------------------------------------------------


def rope_position(cfg: dict[str, Any], head_dim: int, default_fraction: float,
                  theta_key: str = "rope_theta",
                  fraction_key: str = "partial_rotary_factor") -> dict[str, Any]:  # fmt: skip
    """llmkit's ``model.position`` for a family whose rotary fraction defaults to
    ``default_fraction`` (as transformers 5 reads it: ``rope_parameters`` first, then the
    legacy ``rope_scaling`` and the ``theta_key`` / ``fraction_key`` keys, then defaults)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise Refused(f"config rope_parameters={params!r} is not a table")
    params = dict(params)
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", cfg.get(theta_key, 10000.0))
    fraction = params.get("partial_rotary_factor")
    if fraction is None:
        fraction = cfg.get(fraction_key, default_fraction)
    if not 0.0 < float(fraction) <= 1.0:
        raise Refused(f"config {fraction_key}={fraction!r}: the rotary fraction must be in (0, 1]")
    params["partial_rotary_factor"] = fraction
    plain = {k: v for k, v in cfg.items() if k != "rope_scaling"}
    return rope_options(plain | {"rope_parameters": params, fraction_key: fraction}, head_dim,
                        fraction_key)  # fmt: skip


def hf_rope_exact(rs: ResolvedSpec, fraction_key: str = "partial_rotary_factor") -> dict[str, Any]:
    """:func:`hf_rope`, with the rotary fraction written even when it is 1 (these families
    default to less)."""
    out = hf_rope(rs, fraction_key)
    fraction = same_in_every_layer(rs, "position")[1]["rotary_fraction"]
    out[fraction_key] = fraction
    out["rope_parameters"]["partial_rotary_factor"] = fraction
    return out


def layernorm_eps(rs: ResolvedSpec) -> float:
    """The eps of the spec's norms, which must all be one LayerNorm with a bias (these
    families' ``nn.LayerNorm``); refuses anything else by name."""
    name, opts = same_in_every_layer(rs, "norm")
    final = rs.norm.name, rs.norm.options.model_dump()
    if final != (name, opts):
        raise Refused(f"the final norm ({final[0]}) differs from the blocks' norm ({name})")
    if name != "layernorm":
        raise Refused(f"norm {name!r}: this family uses LayerNorm")
    if not effective(rs, opts.get("bias")):
        raise Refused("norm layernorm without a bias: this family's LayerNorms have one")
    if not rs.model.final_norm:
        raise Refused("final_norm=false: this family has a final LayerNorm")
    return opts["eps"]


def biases(model: dict[str, Any], bias: bool, *, qkv: bool | None = None,
           out: bool | None = None) -> dict[str, Any]:  # fmt: skip
    """``model`` with its ``bias`` and the q/k/v and output-projection biases, each written
    only where it differs from ``bias`` (as a spec written by hand leaves them)."""
    model["bias"] = bias
    for key, value in (("qkv_bias", qkv), ("attn_out_bias", out)):
        if value is not None and value != bias:
            model[key] = value
    return model


def with_bias(table: dict[str, Any], model_bias: bool, bias: bool) -> dict[str, Any]:
    """A norm or ffn table with ``bias`` written only where it differs from the model's."""
    return table | ({"bias": bias} if bias != model_bias else {})


def effective(rs: ResolvedSpec, bias: bool | None) -> bool:
    """A bias setting, unset following the model's ``bias``."""
    return bool(rs.model.bias if bias is None else bias)


def attention_biases(rs: ResolvedSpec) -> tuple[bool, bool]:
    """(q/k/v bias, output projection bias) of the spec."""
    m = rs.model
    return effective(rs, m.qkv_bias), effective(rs, m.attn_out_bias)


def ffn_hidden_size(rs: ResolvedSpec, opts: dict[str, Any]) -> int:
    from llmkit.contracts import ffn_hidden

    return ffn_hidden(rs.model.d_model, opts.get("hidden"), opts["multiplier"], opts["multiple_of"])


def plain_attention(rs: ResolvedSpec, family: str, *, windows: bool = False) -> None:
    """Refuse q/k transforms and (unless the family has them) sliding windows."""
    qk, _ = same_in_every_layer(rs, "qk_transform")
    if qk:
        raise Refused(f"qk_transform {qk!r}: {family} has no such q/k transform")
    if not windows and any(w is not None for w in layers_of.windows(rs)):
        raise Refused(f"sliding-window attention: {family} attends to every earlier token")


def block_kind(rs: ResolvedSpec) -> tuple[str, dict[str, Any]]:
    """The spec's block (the same in every layer)."""
    return same_in_every_layer(rs, "block")


def layernorm_rules(us: str, theirs: str) -> list[Rule]:
    return [same(us + ".weight", theirs + ".weight"), same(us + ".bias", theirs + ".bias")]


def linear_rules(us: str, theirs: str, bias: bool) -> list[Rule]:
    out = [same(us + ".weight", theirs + ".weight")]
    if bias:
        out.append(same(us + ".bias", theirs + ".bias"))
    return out


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
