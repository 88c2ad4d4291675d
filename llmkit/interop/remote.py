"""Remote-code export: an llmkit model that no native transformers family holds, written so
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads it.

The checkpoint holds ``config.json`` with ``model_type = "llmkit"``, ``auto_map`` naming the
classes of the two files of :mod:`llmkit.interop.remote_code` (copied verbatim),
``llmkit_spec`` (the run's merged spec, its ``model`` table: what llmkit builds the model
from) and ``llmkit_requires`` (the distributions that provided the model's components, llmkit
and plugins, with their versions); ``model.safetensors`` holds llmkit's own tensors under
``model.`` (a tied head is the embedding, stored once). The remote code imports llmkit where
it is loaded: the model there is llmkit's Transformer, so the logits are llmkit's.

Import reads such a checkpoint back (:func:`is_remote`, :func:`spec_of`,
:func:`llmkit_tensors`): the spec from ``config.json``, the tensors without the prefix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from llmkit.errors import LlmkitError
from llmkit.interop.remote_code import DIRECTORY, FILES
from llmkit.spec import Resolved, ResolvedSpec

MODEL_TYPE = "llmkit"
ARCHITECTURE = "LlmkitForCausalLM"
AUTO_MAP = {
    "AutoConfig": "configuration_llmkit.LlmkitConfig",
    "AutoModelForCausalLM": "modeling_llmkit.LlmkitForCausalLM",
}
#: The wrapper's name of llmkit's Transformer; every tensor name starts with it.
PREFIX = "model."
HEAD, EMBEDDING = "lm_head.weight", "tok_emb.weight"
T = TypeVar("T")


def is_remote(cfg: dict[str, Any]) -> bool:
    """Whether an HF config is an llmkit remote-code export."""
    return cfg.get("model_type") == MODEL_TYPE


def _model_components(rs: ResolvedSpec) -> list[Resolved]:
    found = list(rs.model_slots.values())
    found += [r for plan in rs.layers for r in plan.slots.values()]
    found += [r for s, r in rs.components.items() if s.startswith("model.") and r is not None]
    return found


def requires(rs: ResolvedSpec) -> dict[str, str]:
    """The distributions that provide the model's components, with their versions (llmkit
    first)."""
    from llmkit import __version__

    out = {"llmkit": __version__}
    for res in _model_components(rs):
        out.setdefault(res.record.provider, res.record.version)
    return out


def remote_config(rs: ResolvedSpec) -> dict[str, Any]:
    """``config.json`` of the remote-code export of ``rs`` (without dtype and token ids)."""
    m = rs.model
    # the spec as the run saved it (spec.yaml), JSON as config.json holds it
    spec: dict[str, Any] = {"model": json.loads(json.dumps(rs.raw.get("model") or {}))}
    if rs.spec.name:
        spec = {"name": rs.spec.name} | spec
    return {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "auto_map": dict(AUTO_MAP),
        "llmkit_spec": spec,
        "llmkit_requires": requires(rs),
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.dim_head,
        "max_position_embeddings": m.max_seq_len,
        "tie_word_embeddings": bool(m.tie_embeddings),
    }


def remote_tensors(model: nn.Module, rs: ResolvedSpec) -> dict[str, torch.Tensor]:
    """The wrapper's state dict: llmkit's tensors under ``model.``, a tied head once."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if rs.model.tie_embeddings:
        state.pop(HEAD, None)
    return {PREFIX + k: v for k, v in state.items()}


def write_code(out: Path) -> list[str]:
    """Copy the remote-code files into ``out``, byte for byte; their names."""
    for name in FILES:
        shutil.copyfile(DIRECTORY / name, out / name)
    return list(FILES)


def spec_of(cfg: dict[str, Any], name: str, attention: str = "sdpa") -> dict[str, Any]:
    """The raw llmkit spec of a remote-code export's config (import); ``attention`` other
    than sdpa replaces a model-wide sdpa kernel, as import does for native families."""
    spec = cfg.get("llmkit_spec")
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict):
        raise LlmkitError("config.json of model_type 'llmkit' has no llmkit_spec.model table")
    model = dict(model)
    if attention != "sdpa" and (model.get("attention") or {}).get("name", "sdpa") == "sdpa":
        model["attention"] = {"name": attention}
    return {"name": name, "model": model}


def llmkit_infos(infos: dict[str, T], tied: bool) -> dict[str, T]:
    """llmkit's names for a remote-code export's tensors (headers or tensors alike); a tied
    head is the embedding."""
    out = {}
    for k, v in infos.items():
        if not k.startswith(PREFIX):
            raise LlmkitError(f"tensor {k!r} of an llmkit export is not under {PREFIX!r}")
        out[k.removeprefix(PREFIX)] = v
    if tied and EMBEDDING in out:
        out.setdefault(HEAD, out[EMBEDDING])
    return out


def llmkit_tensors(tensors: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """llmkit's state dict from a remote-code export's tensors."""
    out = {}
    for k, v in tensors.items():
        if not k.startswith(PREFIX):
            raise LlmkitError(f"tensor {k!r} of an llmkit export is not under {PREFIX!r}")
        out[k.removeprefix(PREFIX)] = v
    if tied:
        head = out.get(HEAD)
        if head is not None and EMBEDDING in out and not torch.equal(head, out[EMBEDDING]):
            raise LlmkitError("tie_embeddings is set but lm_head differs from the embedding")
        if EMBEDDING in out:
            out[HEAD] = out[EMBEDDING]
    return out


def in_memory(model: nn.Module, rs: ResolvedSpec) -> nn.Module:
    """The remote-code wrapper around a copy of ``model``'s weights, built in this process
    from the package's own template (no files, no trust_remote_code)."""
    from llmkit.interop.remote_code.configuration_llmkit import LlmkitConfig
    from llmkit.interop.remote_code.modeling_llmkit import LlmkitForCausalLM

    cfg = {k: v for k, v in remote_config(rs).items() if k not in ("model_type", "auto_map")}
    wrapper = LlmkitForCausalLM(LlmkitConfig(**cfg))
    missing, unexpected = wrapper.load_state_dict(remote_tensors(model, rs), strict=False)
    left = set(missing) - ({PREFIX + HEAD} if rs.model.tie_embeddings else set())
    if left or unexpected:
        raise LlmkitError(f"the remote-code model does not take {sorted(left or unexpected)[0]!r}")
    return wrapper.eval()
