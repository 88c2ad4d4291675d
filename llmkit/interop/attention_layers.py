"""Which layers attend through a sliding window, in Hugging Face configs and in llmkit specs.

HF: ``sliding_window`` W for every layer (Mistral, Mixtral, Starcoder2), or for the layers
``layer_types`` marks ``sliding_attention`` (transformers 5; Qwen2/Qwen3 only with
``use_sliding_window``, older configs by ``max_window_layers``). llmkit: the layer's attention
kernel is ``sliding_window`` (or ``dense`` with a ``window``), chosen per layer through
``model.overrides``.
"""

from __future__ import annotations

from typing import Any

from llmkit.interop.family import Refused, part
from llmkit.spec import ResolvedSpec

#: Families whose window is switched on by ``use_sliding_window``.
OPT_IN = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
#: Families whose configs without ``layer_types`` window every other layer (from layer 0).
ALTERNATING = ("gemma2",)
#: Families with one window for every layer (no ``layer_types``).
EVERY_LAYER = ("mistral", "mixtral", "starcoder2")


#: The families whose transformers models attend through a window at all.
WINDOWED = (*OPT_IN, *EVERY_LAYER, "gemma2", "gemma3_text")
#: Qwen MoE models window in their own ways (every layer; even layers): not mapped yet.
UNMAPPED = ("qwen2_moe", "qwen3_moe")


def hf_layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """The window of each layer of an HF config (None: full attention). Families whose
    transformers model has no window ignore ``sliding_window``, as transformers does."""
    n, mt = int(cfg["num_hidden_layers"]), cfg["model_type"]
    w = cfg.get("sliding_window")
    if mt in OPT_IN and not cfg.get("use_sliding_window"):
        w = None
    if not w or mt not in WINDOWED:
        return [None] * n
    if mt in UNMAPPED:
        raise Refused(f"use_sliding_window in a {mt} config: its windowing is not mapped yet")
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise Refused(f"layer_types has {len(types)} entries for {n} layers")
        return [w if t == "sliding_attention" else None for t in types]
    if mt in OPT_IN:
        first = cfg.get("max_window_layers", n)
        return [w if i >= first else None for i in range(n)]
    if mt in ALTERNATING:  # configs before layer_types: even layers slide
        return [w if i % 2 == 0 else None for i in range(n)]
    if mt == "gemma3_text":  # configs before layer_types: every pattern-th layer is global
        pattern = cfg.get("sliding_window_pattern", 6)
        return [w if (i + 1) % pattern else None for i in range(n)]
    return [w] * n


def add_windows(model: dict[str, Any], cfg: dict[str, Any], kernel: str = "sdpa") -> None:
    """Set ``model.attention`` (and overrides for windowed layers) from an HF config."""
    windows = hf_layer_windows(cfg)
    model["attention"] = {"name": kernel}
    if all(w is None for w in windows):
        return
    if len(set(windows)) == 1:
        model["attention"] = {"name": "sliding_window", "window": windows[0]}
        return
    for w in sorted({w for w in windows if w is not None}):
        picked = [i for i, x in enumerate(windows) if x == w]
        model.setdefault("overrides", []).append(
            {"layers": picked, "attention": {"name": "sliding_window", "window": w}}
        )


def windows(rs: ResolvedSpec) -> list[int | None]:
    """The window of each layer's attention kernel (None: it attends every earlier key)."""
    out: list[int | None] = []
    for j in range(len(rs.layers)):
        name, opts = part(rs, "attention", j)
        out.append(opts.get("window") if name in ("sliding_window", "dense") else None)
    return out


def hf_windows(rs: ResolvedSpec, model_type: str) -> dict[str, Any]:
    """The HF config keys that give each layer its window."""
    per_layer = windows(rs)
    sizes = {w for w in per_layer if w is not None}
    if not sizes:
        return {"sliding_window": None} | (
            {"use_sliding_window": False} if model_type in OPT_IN else {}
        )
    if len(sizes) > 1:
        raise Refused(f"layers use different windows {sorted(sizes)}")
    (w,) = sizes
    if model_type not in WINDOWED or model_type in UNMAPPED:
        raise Refused(f"a sliding window: transformers' {model_type} attends in full")
    if model_type in EVERY_LAYER:
        if None in per_layer:
            raise Refused(f"{model_type} windows every layer; some layers here attend in full")
        return {"sliding_window": w}
    types = ["sliding_attention" if x else "full_attention" for x in per_layer]
    cfg: dict[str, Any] = {"sliding_window": w, "layer_types": types}
    if model_type in OPT_IN:
        first = types.index("sliding_attention")
        if "full_attention" in types[first:]:
            raise Refused("windowed layers must be the last ones (max_window_layers)")
        cfg |= {"use_sliding_window": True, "max_window_layers": first}
    return cfg
