"""Small builders shared by tests."""

from __future__ import annotations

from typing import Any

from llmkit.components import builtin
from llmkit.registry import Registry


def tiny_spec(**model: Any) -> dict[str, Any]:
    """A spec dict for a tiny model; keyword arguments override model fields."""
    base: dict[str, Any] = {
        "vocab_size": 64,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "max_seq_len": 32,
        "attention": {"name": "sdpa"},
        "ffn": {"name": "mlp"},
        "norm": {"name": "layernorm"},
        "position": {"name": "learned"},
    }
    base.update(model)
    return {"model": base}


def registry_with(*plugins: Any) -> Registry:
    """A fresh registry holding the built-in plugin and the given plugin objects."""
    reg = Registry()
    reg.add_plugin(builtin, "builtin", "llmkit", "0")
    for i, plugin in enumerate(plugins):
        dist = getattr(plugin, "distribution", f"fake-{i}")
        reg.add_plugin(plugin, getattr(plugin, "name", f"fake{i}"), dist, "1.0")
    return reg
