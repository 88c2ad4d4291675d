"""What the Hugging Face families (:mod:`llmkit.interop.families`) share: checks of a spec
and tensor rules used by more than one family. A family module imports from here (and from
the other non-family interop modules), never from another family module.

- the LayerNorm families with rotary positions (GPT-NeoX, Phi, StableLM, Starcoder2):
  rotary defaults, the LayerNorm and bias checks, LayerNorm and linear rules;
- the learned-position families (GPT-2, OPT, MPT): what a spec must be to hold their
  "plain" multi-head attention, a LayerNorm and an MLP;
- every family: the effective attention biases (Llama's too).
"""

from __future__ import annotations

from typing import Any

from llmkit.interop import attention_layers as layers_of
from llmkit.interop.family import Refused, same_in_every_layer
from llmkit.interop.mapping import Rule, same
from llmkit.interop.rotary import hf_rope, rope_options
from llmkit.spec import ResolvedSpec

# -- the LayerNorm families with rotary positions: GPT-NeoX, Phi, StableLM, Starcoder2 ------


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


# -- the learned-position families: GPT-2, OPT, MPT ------------------------------------------


def plain_mha(rs: ResolvedSpec) -> None:
    """Multi-head attention over every earlier key, no q/k transform, a plain embedding and
    a plain head: what GPT-2, OPT and MPT have in common."""
    m = rs.model
    if m.kv_heads != m.n_heads:
        raise Refused(f"n_kv_heads {m.kv_heads} (this family has multi-head attention only)")
    if m.dim_head * m.n_heads != m.d_model:
        raise Refused(f"head_dim {m.dim_head} is not d_model / n_heads")
    if same_in_every_layer(rs, "qk_transform")[0]:
        raise Refused("qk_transform (this family has no q/k normalization)")
    sizes = {w for w in layers_of.windows(rs) if w is not None}
    if sizes:
        raise Refused(f"a sliding window of {min(sizes)} (this family attends in full)")
    for j in range(len(rs.layers)):
        if rs.layers[j].attention.options.model_dump().get("softcap") is not None:
            raise Refused(f"attention softcap in layer {j}")
    if m.embedding_scale != 1.0:
        raise Refused(f"embedding_scale {m.embedding_scale!r}")
    if m.logit_softcap is not None:
        raise Refused(f"logit_softcap {m.logit_softcap}")
    if m.head_bias:
        raise Refused("head_bias (this family's head has no bias)")


def learned_positions(rs: ResolvedSpec) -> None:
    """Learned absolute positions for the whole model."""
    name, _ = same_in_every_layer(rs, "position")
    if rs.position.name != "learned" or name != "learned":
        raise Refused(f"position {rs.position.name!r} (this family has learned positions)")


def layernorm(rs: ResolvedSpec) -> tuple[float, bool]:
    """(eps, bias) of a LayerNorm used everywhere (each layer and the final norm)."""
    name, opts = same_in_every_layer(rs, "norm")
    final = (rs.norm.name, rs.norm.options.model_dump())
    if rs.model.final_norm and final != (name, opts):
        raise Refused("the final norm differs from the layers' norms")
    if name != "layernorm":
        raise Refused(f"norm {name!r} (this family has LayerNorm)")
    bias = rs.model.bias if opts.get("bias") is None else opts["bias"]
    return opts["eps"], bool(bias)


def mlp(rs: ResolvedSpec) -> tuple[str, int | None, bool]:
    """(activation, hidden size, bias) of a two-layer MLP used in every layer; the hidden
    size is None when the spec leaves it to the default 4·d_model (an HF config then leaves
    it out too, so the spec reads back the same)."""
    from llmkit.contracts import ffn_hidden

    name, opts = same_in_every_layer(rs, "ffn")
    if name != "mlp":
        raise Refused(f"ffn {name!r} (this family has a two-layer MLP)")
    hidden = opts.get("hidden")
    if not hidden and (opts["multiplier"], opts["multiple_of"]) != (4.0, 1):
        hidden = ffn_hidden(rs.model.d_model, None, opts["multiplier"], opts["multiple_of"])
    bias = rs.model.bias if opts.get("bias") is None else opts["bias"]
    return opts["activation"], hidden or None, bool(bias)
