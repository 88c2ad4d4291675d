"""From a corpus source to batches of token ids.

:func:`prepare_data` builds the spec's source, trains (or loads) the tokenizer, tokenizes
each split once with ``datasets.map`` and streams the ids into a flat token file
``<cache>/<split>-<key>.bin`` (``uint16`` for vocabularies up to 65535, else ``uint32``)
beside a JSON sidecar. ``key`` hashes the source, its input files, the seed and the
tokenizer, so a changed corpus or tokenizer never reuses a stale file, and an unchanged one
is never tokenized twice.

:class:`BlockSampler` cuts a :class:`TokenFile` into packed, non-overlapping blocks of
``block_size + 1`` tokens and visits them in a seeded per-epoch order, resumably and
sharded across ranks; :func:`eval_batches` yields the same evenly spaced validation blocks
at every evaluation.

Chat data (a source with ``chat_format()``, see ``docs/chat-data.md``) is rendered with its
template (:mod:`llmkit.data.chat`) and written with a loss mask and document offsets beside
the ids; every sampler then gives targets of -100 outside the assistant's turns, and
:class:`PaddedSampler` (``data.sampling = "padded"``) gives one conversation per row.
"""

from llmkit.data.chat_prepare import iter_chat_texts
from llmkit.data.prepare import (
    SPLITS,
    PreparedData,
    count_text_bytes,
    data_key,
    iter_texts,
    prepare_data,
    tokenize_chat_split,
    tokenize_split,
)
from llmkit.data.samplers import (
    IGNORE,
    BlockSampler,
    PaddedSampler,
    RandomWindowSampler,
    count_blocks,
    eval_batches,
    eval_rows,
    make_sampler,
    padded_examples,
)
from llmkit.data.tokens import (
    FORMAT_VERSION,
    TokenFile,
    sidecar,
    token_dtype,
    write_masked_token_file,
    write_token_file,
)

__all__ = [
    "FORMAT_VERSION",
    "IGNORE",
    "SPLITS",
    "BlockSampler",
    "PaddedSampler",
    "PreparedData",
    "RandomWindowSampler",
    "TokenFile",
    "count_blocks",
    "count_text_bytes",
    "data_key",
    "eval_batches",
    "eval_rows",
    "iter_chat_texts",
    "iter_texts",
    "make_sampler",
    "padded_examples",
    "prepare_data",
    "sidecar",
    "token_dtype",
    "tokenize_chat_split",
    "tokenize_split",
    "write_masked_token_file",
    "write_token_file",
]
