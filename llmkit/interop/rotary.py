"""Rotary settings between Hugging Face configs (``rope_parameters``, or the older
``rope_theta`` + ``rope_scaling``, with a partial-rotary fraction) and llmkit's ``rope``
component options (the mapping itself: :mod:`llmkit.components.position.rope_scaling`).
The options are validated by the registered ``position.rope`` component's options model."""

from __future__ import annotations

from typing import Any

from llmkit.interop.family import Refused, rope_parameters, same_in_every_layer
from llmkit.registry import get_registry
from llmkit.spec import ResolvedSpec


def rope_options(
    cfg: dict[str, Any], head_dim: int, fraction_key: str = "partial_rotary_factor"
) -> dict[str, Any]:
    """llmkit's ``model.position`` table for an HF config."""
    fraction = cfg.get(fraction_key) or 1.0
    try:
        return rope_options_from_hf(
            rope_parameters(cfg), head_dim, fraction, cfg.get("max_position_embeddings")
        )
    except (ValueError, KeyError) as exc:
        raise Refused(f"rotary parameters: {exc}") from exc


def hf_rope(rs: ResolvedSpec, fraction_key: str = "partial_rotary_factor") -> dict[str, Any]:
    """The HF config keys of the spec's rotary scheme (the same in every layer): transformers
    5's ``rope_parameters``, and ``rope_theta`` / ``rope_scaling`` for older readers."""
    name, opts = same_in_every_layer(rs, "position")
    if name != "rope":
        raise Refused(f"position {name!r}: this family uses rotary embeddings")
    if opts.get("pairing", "half") != "half":
        raise Refused("rope pairing 'interleaved': transformers rotates halves in this family")
    try:
        params = rope_parameters_to_hf(opts)
    except ValueError as exc:
        raise Refused(str(exc)) from exc
    out: dict[str, Any] = {"rope_parameters": params, "rope_theta": params["rope_theta"]}
    fraction = params.get("partial_rotary_factor")
    if fraction is not None:
        out[fraction_key] = fraction
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    out["rope_scaling"] = None if scaling.get("rope_type") == "default" else scaling
    return out


# -- rope_parameters <-> rope options ---------------------------------------------------------


def rope_options_from_hf(
    rope_parameters: dict[str, Any],
    head_dim: int,
    partial_rotary_factor: float = 1.0,
    max_position_embeddings: int | None = None,
    *,
    pairing: str = "half",
) -> dict[str, Any]:
    """llmkit ``rope`` options (with ``name``) computing what transformers computes for a
    config with these ``rope_parameters`` (``rope_scaling`` in older configs; keys as in
    ``transformers.modeling_rope_utils.RopeParameters``), ``head_dim``, the config's
    ``partial_rotary_factor`` (one inside ``rope_parameters`` wins, as in transformers) and
    ``max_position_embeddings``, which transformers' dynamic NTK takes as the original context
    and yarn/longrope use when ``factor`` or ``original_max_position_embeddings`` is absent.
    ``pairing``: "interleaved" for checkpoints whose q/k rotate adjacent pairs (DeepSeek's
    ``rope_interleave``, GPT-J); rope_parameters never say so."""
    p = dict(rope_parameters or {})
    rope_type = p.get("rope_type") or p.get("type") or "default"
    fraction = float(p.get("partial_rotary_factor") or partial_rotary_factor or 1.0)
    out: dict[str, Any] = {"name": "rope", "theta": float(p.get("rope_theta", 10000.0))}
    if fraction != 1.0:
        out["rotary_fraction"] = fraction
    if pairing != "half":
        out["pairing"] = pairing
    old_len = p.get("original_max_position_embeddings") or max_position_embeddings
    factor = p.get("factor")
    if rope_type in ("yarn", "longrope") and factor is None:
        if not (old_len and max_position_embeddings):
            raise ValueError(
                f"rope_type {rope_type!r} without factor needs max_position_embeddings"
            )
        factor = max_position_embeddings / old_len
    if rope_type == "default":
        return out
    if rope_type not in ("linear", "dynamic", "llama3", "yarn", "longrope"):
        raise ValueError(f"rope_type {rope_type!r} has no llmkit rope equivalent")
    out["scaling"] = rope_type
    if rope_type == "dynamic":
        old_len = max_position_embeddings  # transformers ignores original_max_position_embeddings
    if rope_type != "linear":
        if not old_len:
            raise ValueError(f"rope_type {rope_type!r} needs max_position_embeddings")
        out["original_max_seq_len"] = int(old_len)
    if factor is None:
        raise ValueError(f"rope_type {rope_type!r} needs factor")
    if rope_type in ("linear", "dynamic", "llama3", "yarn"):
        out["scaling_factor"] = float(factor)
    if rope_type == "llama3":
        out["low_freq_factor"] = float(p["low_freq_factor"])
        out["high_freq_factor"] = float(p["high_freq_factor"])
    elif rope_type == "yarn":
        out["beta_fast"] = float(p.get("beta_fast") or 32.0)
        out["beta_slow"] = float(p.get("beta_slow") or 1.0)
        out["truncate"] = bool(p.get("truncate", True))
        if p.get("attention_factor") is not None:
            out["attention_factor"] = float(p["attention_factor"])
        elif p.get("mscale") and p.get("mscale_all_dim"):
            out["mscale"], out["mscale_all_dim"] = float(p["mscale"]), float(p["mscale_all_dim"])
    elif rope_type == "longrope":
        half = int(head_dim * fraction) // 2
        if not len(p["short_factor"]) == len(p["long_factor"]) == half:
            raise ValueError(
                f"longrope short_factor/long_factor have {len(p['short_factor'])}/"
                f"{len(p['long_factor'])} numbers; head_dim {head_dim} × {fraction} needs {half}"
            )
        out["short_factor"] = [float(x) for x in p["short_factor"]]
        out["long_factor"] = [float(x) for x in p["long_factor"]]
        if p.get("attention_factor") is not None:
            out["attention_factor"] = float(p["attention_factor"])
        else:  # factor only feeds the default attention factor, 1 for factor ≤ 1
            out["scaling_factor"] = max(float(factor), 1.0)
    return out


def rope_parameters_to_hf(options: dict[str, Any]) -> dict[str, Any]:
    """transformers ``rope_parameters`` for llmkit ``rope`` options (``name`` optional), the
    inverse of :func:`rope_options_from_hf`. Not expressed there: ``pairing`` (transformers'
    Llama rotates halves: export interleaved q/k weights permuted, as
    convert_llama_weights_to_hf does) and, for ``scaling='dynamic'``, the original context:
    transformers reads it from the config's ``max_position_embeddings``, which must be set to
    ``original_max_seq_len``. ``ntk`` (static NTK-aware base) has no transformers rope_type:
    a ValueError (export the default type with the scaled base as ``rope_theta``)."""
    opts = dict(options)
    if opts.pop("name", "rope") != "rope":
        raise ValueError(f"not rope options: name {options['name']!r}")
    o = get_registry().get("position", "rope").parse_options(opts)
    out: dict[str, Any] = {"rope_type": o.scaling, "rope_theta": o.theta}
    if o.rotary_fraction != 1.0:
        out["partial_rotary_factor"] = o.rotary_fraction
    if o.scaling == "ntk":
        raise ValueError(
            "scaling='ntk' has no transformers rope_type; export a default rope with "
            "theta·factor^(rot_dim/(rot_dim−2)) as rope_theta"
        )
    if o.scaling == "none":
        out["rope_type"] = "default"
        return out
    if o.scaling != "longrope" or o.attention_factor is None:
        out["factor"] = o.scaling_factor
    if o.scaling in ("llama3", "yarn", "longrope"):
        out["original_max_position_embeddings"] = o.original_max_seq_len
    if o.scaling == "llama3":
        out["low_freq_factor"] = o.low_freq_factor
        out["high_freq_factor"] = o.high_freq_factor
    elif o.scaling == "yarn":
        out.update(beta_fast=o.beta_fast, beta_slow=o.beta_slow, truncate=o.truncate)
        if o.mscale is not None:
            out.update(mscale=o.mscale, mscale_all_dim=o.mscale_all_dim)
    elif o.scaling == "longrope":
        out["short_factor"] = list(o.short_factor or ())
        out["long_factor"] = list(o.long_factor or ())
    if o.scaling in ("yarn", "longrope") and o.attention_factor is not None:
        out["attention_factor"] = o.attention_factor
    return out
