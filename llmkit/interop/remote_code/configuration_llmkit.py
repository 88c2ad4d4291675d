"""The configuration of an llmkit model exported as remote code (``llmkit export-hf``).

Copied verbatim from llmkit/interop/remote_code/ into the checkpoint. ``llmkit_spec`` is the
llmkit spec the model is built from (its ``model`` table, as the run saved it);
``llmkit_requires`` names the distributions that provided its components (llmkit and any
plugin), with the versions that exported it. The other fields are informational, for tools
that read the usual names; llmkit reads only the spec. Loading this file needs transformers
alone (AutoConfig works without llmkit); the model needs llmkit.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class LlmkitConfig(PretrainedConfig):
    model_type = "llmkit"

    def __init__(
        self,
        llmkit_spec: dict[str, Any] | None = None,
        llmkit_requires: dict[str, str] | None = None,
        vocab_size: int | None = None,
        hidden_size: int | None = None,
        num_hidden_layers: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        max_position_embeddings: int | None = None,
        tie_word_embeddings: bool = True,
        **kwargs: Any,
    ) -> None:
        self.llmkit_spec = dict(llmkit_spec or {})
        self.llmkit_requires = dict(llmkit_requires or {})
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.tie_word_embeddings = tie_word_embeddings
