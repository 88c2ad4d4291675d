"""Rotary settings between Hugging Face configs (``rope_parameters``, or the older
``rope_theta`` + ``rope_scaling``, with a partial-rotary fraction) and llmkit's ``rope``
component options (the mapping itself: :mod:`llmkit.components.position.rope_scaling`)."""

from __future__ import annotations

from typing import Any

from llmkit.components.position.rope_scaling import rope_options_from_hf, rope_parameters_to_hf
from llmkit.interop.family import Refused, rope_parameters, same_in_every_layer
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
