"""Text generation: greedy decoding, sampling and beam search over the KV cache.

Strategies: greedy (``temperature = 0``), temperature sampling with top-k, top-p (nucleus,
Holtzman et al. 2020) and min-p (Nguyen et al. 2024) filters, the CTRL repetition penalty
(Keskar et al. 2019), and beam search with a length penalty and early stopping. Generation
ends per row at an EOS id, at a stop string, or after ``max_new_tokens``.

Batches of prompts of different lengths are left-padded; the padding is masked out of
attention (``key_padding_mask``) and every row is positioned as if it were alone, so a
batched generation equals generating each prompt by itself.

When every component of the model can decode through a KV cache (``supports_kv_cache``)
each step feeds one token per row; otherwise each step runs a full forward over the last
``max_seq_len`` tokens. When the context reaches ``max_seq_len`` the cache is rebuilt from
the most recent half of it, so generation can go on as long as asked.

The Python API::

    gen = Generator("runs/tiny-...")                    # or Generator(model, tokenizer)
    gen.generate(["def ", "import"], max_new_tokens=50, temperature=0.8, top_p=0.95)
    # -> [GenerationResult(text=..., ids=[...], finish_reason="length"), ...]
    stream = gen.stream("def ", max_new_tokens=50)
    for piece in stream:                                # text as it is generated
        print(piece, end="", flush=True)
    stream.result                                       # the GenerationResult

Modules: :mod:`~llmkit.inference.sampling` (settings, logits filters),
:mod:`~llmkit.inference.streaming` (text as it is generated), :mod:`~llmkit.inference.decode`
(the decoding loops), :mod:`~llmkit.inference.layout` (the CPU decoding weight layout),
:mod:`~llmkit.inference.checks` (what is refused before decoding: invalid text, non-finite
weights, a batch too large for the memory left),
:mod:`~llmkit.inference.generator` (the entry points) and :mod:`~llmkit.inference.quantize`
(int8 weights). This package re-exports the public API.
"""

from llmkit.inference.checks import GenerationError
from llmkit.inference.generator import Generator, generate_batch, generate_ids
from llmkit.inference.layout import prepare_for_decoding
from llmkit.inference.sampling import (
    FinishReason,
    GenerationResult,
    Sampling,
    apply_repetition_penalty,
    filter_logits,
)
from llmkit.inference.streaming import IncrementalDecoder, TextStream, TokenizerLike

__all__ = [
    "FinishReason",
    "GenerationError",
    "GenerationResult",
    "Generator",
    "IncrementalDecoder",
    "Sampling",
    "TextStream",
    "TokenizerLike",
    "apply_repetition_penalty",
    "filter_logits",
    "generate_batch",
    "generate_ids",
    "prepare_for_decoding",
]
