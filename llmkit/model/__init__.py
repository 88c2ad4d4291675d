"""The model wing: the decoder-only Transformer assembled from resolved components.

- :mod:`.transformer`: :class:`Transformer`, :class:`ModelOutput`, :func:`build_model`, init;
- :mod:`.attention`: the attention *module* (projections, q/k transform, positional hooks,
  KV cache) around the registered attention *kernel*;
- :mod:`.cache`: :class:`KVCache` and its per-layer :class:`LayerCache` buffers;
- :mod:`.documents`: document ids of packed rows (:func:`document_ids_from_eos`), the
  ``document_ids=`` of :meth:`Transformer.forward`;
- :mod:`.accounting`: parameters, FLOPs, KV-cache bytes and training memory;
- :mod:`.objective`: :class:`Objective`, the model's cross-entropy or the spec's ``loss``
  component: what training minimizes and what evaluation reports as the loss.

Blocks are components of the ``block`` kind (``llmkit/components/block/``) following
:mod:`llmkit.contracts`.
"""

from llmkit.contracts import AttentionInputs, Block, BlockParts, QKTransform
from llmkit.model.attention import Attention
from llmkit.model.cache import KVCache, LayerCache
from llmkit.model.documents import (
    document_ids_from_bounds,
    document_ids_from_eos,
    document_positions,
)
from llmkit.model.objective import Objective, ObjectiveOutput
from llmkit.model.transformer import (
    ModelOutput,
    Transformer,
    build,
    build_model,
    build_on_meta,
    build_problems,
)

__all__ = [
    "Attention",
    "AttentionInputs",
    "Block",
    "BlockParts",
    "KVCache",
    "LayerCache",
    "ModelOutput",
    "Objective",
    "ObjectiveOutput",
    "QKTransform",
    "Transformer",
    "build",
    "build_model",
    "build_on_meta",
    "build_problems",
    "document_ids_from_bounds",
    "document_ids_from_eos",
    "document_positions",
]
