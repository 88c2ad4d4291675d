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
"""

from llmkit.data.prepare import (
    SPLITS,
    PreparedData,
    count_text_bytes,
    data_key,
    iter_texts,
    prepare_data,
    tokenize_split,
)
from llmkit.data.samplers import (
    BlockSampler,
    RandomWindowSampler,
    count_blocks,
    eval_batches,
    make_sampler,
)
from llmkit.data.tokens import FORMAT_VERSION, TokenFile, sidecar, token_dtype, write_token_file

__all__ = [
    "FORMAT_VERSION",
    "SPLITS",
    "BlockSampler",
    "PreparedData",
    "RandomWindowSampler",
    "TokenFile",
    "count_blocks",
    "count_text_bytes",
    "data_key",
    "eval_batches",
    "iter_texts",
    "make_sampler",
    "prepare_data",
    "sidecar",
    "token_dtype",
    "tokenize_split",
    "write_token_file",
]
