"""An llmkit model as a transformers model, written by ``llmkit export-hf`` into a checkpoint
that no native transformers family holds; load it with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``.

Copied verbatim from llmkit/interop/remote_code/. The model is llmkit's own Transformer,
built from the spec in config.json (``llmkit_spec``) with the weights of model.safetensors
(llmkit's tensor names under ``model.``), so it computes exactly what llmkit computes. llmkit
must be installed where it is loaded, with every plugin config.json lists under
``llmkit_requires``; this file downloads nothing and imports nothing else.

``forward(input_ids, attention_mask=None, labels=None)`` returns logits and, with labels,
the mean next-token cross-entropy (labels shifted inside, -100 ignored). ``generate()``
decodes through llmkit's KV cache where every component supports one, else recomputes the
whole sequence at each step.
"""

from __future__ import annotations

import copy
import importlib.metadata
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_llmkit import LlmkitConfig

try:
    from llmkit import LlmkitError, build_model, resolve
    from llmkit import __version__ as LLMKIT_VERSION
except ImportError as exc:
    raise ImportError(
        "this checkpoint is an llmkit model exported as remote code: loading it needs the "
        "llmkit package installed (and the plugins config.json lists under llmkit_requires); "
        f"importing llmkit failed: {exc}"
    ) from exc

_V5 = int(transformers.__version__.split(".")[0]) >= 5
#: Where transformers passes the cache (``cache`` in recent versions, ``past_key_values``).
_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _missing(requires: dict[str, str]) -> list[str]:
    """The distributions of ``llmkit_requires`` (llmkit's plugins) not installed here."""
    out = []
    for dist, version in requires.items():
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{dist} {version}")
    return out


def resolve_spec(config: LlmkitConfig) -> Any:
    """llmkit's resolved spec of the checkpoint; an ImportError naming what is missing when
    this installation does not provide one of its components."""
    spec = copy.deepcopy(getattr(config, "llmkit_spec", None) or {})
    if not isinstance(spec.get("model"), dict):
        raise ValueError("config.json has no llmkit_spec with a model table: not an llmkit export")
    requires = dict(getattr(config, "llmkit_requires", None) or {})
    try:
        return resolve(spec, source="config.json (llmkit_spec)")
    except LlmkitError as exc:
        missing = _missing(requires)
        need = ", ".join(f"{d} {v}" for d, v in requires.items()) or "llmkit"
        hint = (
            f"install the llmkit plugin(s) {', '.join(missing)}"
            if missing
            else f"it was exported with {need}; a plugin must also be allowed by "
            "$LLMKIT_PLUGINS when that is set"
        )
        raise ImportError(
            f"this llmkit model needs components llmkit {LLMKIT_VERSION} here does not "
            f"provide ({hint}): {exc}"
        ) from exc


class LlmkitCache:
    """llmkit's KV cache as generate() carries it between steps."""

    is_compileable = False

    def __init__(self, kv: Any) -> None:
        self.kv = kv

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.kv.position)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.kv.reorder(beam_idx)


class LlmkitForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LlmkitConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _tied_weights_keys = (
        {"model.lm_head.weight": "model.tok_emb.weight"} if _V5 else ["model.lm_head.weight"]
    )

    def __init__(self, config: LlmkitConfig) -> None:
        super().__init__(config)
        rs = resolve_spec(config)
        if torch.empty(()).device.type == "meta":
            # transformers builds on the meta device and loads the weights into it; the
            # buffers llmkit computes as it builds (RoPE tables, ALiBi slopes) are not in the
            # weights, so the model is built for real and those are put back after loading
            with torch.device("cpu"):
                self.model = build_model(rs)
        else:
            self.model = build_model(rs)
        self._computed_buffers = {
            id(module): {
                name: buf.detach().clone()
                for name, buf in module.named_buffers(recurse=False)
                if name in module._non_persistent_buffers_set
            }
            for module in self.model.modules()
        }
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Nothing to initialize (llmkit initialized the model as it built it, and the weights
        come from the checkpoint) but the buffers llmkit computed: put back as built."""
        for name, value in getattr(self, "_computed_buffers", {}).get(id(module), {}).items():
            current = module._buffers.get(name)
            device = current.device if current is not None else value.device
            module._buffers[name] = value.to(device)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # llmkit's own cache (LlmkitCache), made by forward

    def get_input_embeddings(self) -> nn.Module:
        return self.model.tok_emb

    def get_output_embeddings(self) -> nn.Module:
        return self.model.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("an llmkit model takes input_ids (not inputs_embeds)")
        past = kwargs.get("cache", kwargs.get("past_key_values"))
        kv = past.kv if isinstance(past, LlmkitCache) else None
        if kv is None and use_cache and labels is None and self.model.supports_kv_cache:
            kv = self.model.new_cache()
        mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("an llmkit model takes a 2-D attention_mask (1 = real token)")
            if not bool(attention_mask.bool().all()):
                mask = attention_mask.bool()
        out = self.model(
            input_ids,
            cache=kv,
            positions=position_ids,
            key_padding_mask=mask,
            last_only=labels is None and logits_to_keep == 1,
        )
        logits = out.logits
        if labels is None and isinstance(logits_to_keep, int) and logits_to_keep > 1:
            logits = logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].to(logits.device).reshape(-1)
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.size(-1)), shifted, ignore_index=-100
            )
        result = CausalLMOutputWithPast(loss=loss, logits=logits)
        if kv is not None:
            result[_CACHE] = LlmkitCache(kv)
        return result

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The tokens the cache has not seen (all of them without a cache), the whole mask."""
        past = kwargs.get("cache", kwargs.get("past_key_values"))
        inputs: dict[str, Any] = {"attention_mask": attention_mask, "use_cache": use_cache}
        if isinstance(past, LlmkitCache):
            input_ids = input_ids[:, past.kv.position :]
            inputs[_CACHE] = past
        if kwargs.get("logits_to_keep") is not None:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        inputs["input_ids"] = input_ids
        return inputs
