"""What a Hugging Face architecture family provides to import and export, and the shared
config helpers (activations, rotary parameters, tied embeddings).

A :class:`Family` (one module per family under :mod:`llmkit.interop.families`) turns an HF
``config.json`` into llmkit's ``model`` table (:meth:`Family.spec`), lists the tensor rules
for that config (:meth:`Family.rules`), and writes an HF config for a resolved llmkit spec
(:meth:`Family.hf_config`), raising :class:`Refused` — naming the component or setting —
when the spec has something the family cannot hold. Model code never looks at the family:
every difference is an explicit option of a component, the block or the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from llmkit.errors import LlmkitError
from llmkit.interop.mapping import Rule
from llmkit.spec import ResolvedSpec


class Refused(LlmkitError):
    """A checkpoint or a spec this family cannot convert; the message names why."""


class Family(ABC):
    """One Hugging Face architecture family."""

    #: ``model_type`` → the ``*ForCausalLM`` class name transformers knows it by.
    architectures: ClassVar[dict[str, str]] = {}
    #: Export asks families in ascending priority for a config that holds a spec.
    priority: int = 50
    #: ``model_type`` → config values transformers' config class assumes when a key is
    #: missing, where they differ from the family's usual ones.
    defaults: ClassVar[dict[str, dict[str, Any]]] = {}
    #: The base model's prefix in ``*ForCausalLM`` tensor names (transformers'
    #: ``base_model_prefix`` + "."): a checkpoint saved from the base model (the hub's GPT-2
    #: files) has names without it, which import adds back.
    prefix: str = "model."
    #: Tensors of the causal-LM head, outside the base model (never prefixed).
    head_names: ClassVar[tuple[str, ...]] = ("lm_head.", "embed_out.")
    #: HF tensor name patterns that hold no weights (buffers): skipped on import.
    ignore: ClassVar[tuple[str, ...]] = ("*.rotary_emb.inv_freq",)

    @abstractmethod
    def spec(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """llmkit's ``model`` table for an HF config (raises :class:`Refused`)."""

    @abstractmethod
    def rules(self, cfg: dict[str, Any]) -> list[Rule]:
        """The tensor rules for an HF config (tied heads: no rule for ``lm_head``)."""

    def notes(self, cfg: dict[str, Any]) -> list[str]:
        """What a user should know about importing this config (shown by ``import-hf``)."""
        return []

    @abstractmethod
    def hf_config(self, rs: ResolvedSpec) -> dict[str, Any]:
        """An HF config (with ``model_type``) for a resolved spec (raises :class:`Refused`)."""


# -- config helpers ---------------------------------------------------------------------------


def need(cfg: dict[str, Any], key: str) -> Any:
    """A config value that must be there."""
    if cfg.get(key) is None:
        raise Refused(f"config.json has no {key!r}")
    return cfg[key]


def dimensions(cfg: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """llmkit's sizes from the config keys most families share (Llama's names);
    ``max_positions`` when the config has no ``max_position_embeddings``."""
    d, heads = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
    return {
        "vocab_size": need(cfg, "vocab_size"),
        "d_model": d,
        "n_layers": need(cfg, "num_hidden_layers"),
        "n_heads": heads,
        "n_kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or d // heads,
        "max_seq_len": cfg.get("max_position_embeddings", max_positions),
        "init_std": cfg.get("initializer_range", 0.02),
    }


def hf_dimensions(rs: ResolvedSpec) -> dict[str, Any]:
    """The config keys of :func:`dimensions`, and ``tie_word_embeddings``, for a spec."""
    m = rs.model
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.dim_head,
        "max_position_embeddings": m.max_seq_len,
        "initializer_range": m.init_std,
        "tie_word_embeddings": m.tie_embeddings,
    }


def refuse_set(cfg: dict[str, Any], **unsupported: Any) -> None:
    """Refuse a config whose ``key`` is set to anything but its harmless value."""
    for key, harmless in unsupported.items():
        if key not in cfg:
            continue
        value = cfg[key]
        ok = harmless(value) if callable(harmless) else value == harmless
        if not ok:
            raise Refused(f"config {key}={value!r} has no llmkit equivalent")


#: HF activation names (transformers' ACT2FN) → llmkit's mlp activations.
ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "relu2": "relu2",
}
#: llmkit → HF: the names transformers reads back without custom code.
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_tanh": "gelu_pytorch_tanh",
    "relu": "relu",
    "silu": "silu",
    "relu2": "relu2",
}


def activation(name: Any) -> str:
    if name not in ACTIVATIONS:
        raise Refused(f"activation {name!r} has no llmkit equivalent")
    return ACTIVATIONS[name]


def hf_activation(name: str) -> str:
    if name not in HF_ACTIVATIONS:
        raise Refused(f"activation {name!r} has no Hugging Face equivalent")
    return HF_ACTIVATIONS[name]


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config's rotary parameters in transformers 5's ``rope_parameters`` form, also
    from the older ``rope_theta`` + ``rope_scaling`` keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "rope_type" in params or "rope_theta" in params:
            return dict(params)
        raise Refused("per-layer-type rope_parameters have no llmkit equivalent yet")
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict):
        out.update(scaling)
        out["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return out


def part(rs: ResolvedSpec, kind: str, layer: int = 0) -> tuple[str, dict[str, Any]]:
    """(name, options) of a per-layer kind's component in one layer; ("", {}) when absent."""
    chosen = rs.layers[layer].get(kind)
    if chosen is None:
        return "", {}
    return chosen.name, chosen.options.model_dump()


def same_in_every_layer(rs: ResolvedSpec, kind: str) -> tuple[str, dict[str, Any]]:
    """A per-layer kind's component, which must be the same in every layer."""
    first = part(rs, kind, 0)
    for j in range(1, len(rs.layers)):
        if part(rs, kind, j) != first:
            raise Refused(f"model.{kind} differs between layers 0 and {j}")
    return first
