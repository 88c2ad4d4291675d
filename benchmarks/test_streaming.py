"""Streamed data (``llmkit.data.streaming``) against a prepared token file: tokens per
second that ``StreamSampler`` hands out while tokenizing JSONL on the fly (2 DataLoader
workers, and none), and that ``BlockSampler`` draws from the same corpus tokenized
beforehand. One pytest-benchmark group; ``extra_info["tokens_per_s"]`` is the number.

The corpus is synthetic prose (Zipf-distributed made-up words, documents of 20–400 words)
and the tokenizer a byte-level BPE trained on its start. Quick mode: 2 MB, BPE 1024,
batch 8 × 128, 300 batches a round; ``LLMKIT_BENCH=full``: 32 MB, BPE 8192, batch 16 × 512,
200 batches a round.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.conftest import FULL
from llmkit.data.samplers import BlockSampler
from llmkit.data.streaming import StreamSampler
from llmkit.data.tokenizer import Tokenizer, train_bpe

MB = 32 if FULL else 2
VOCAB = 8192 if FULL else 1024
BATCH, BLOCK = (16, 512) if FULL else (8, 128)
#: Batches drawn per timed round: many times what the readers hold tokenized ahead (8 lanes
#: of up to 64 documents each), so a round measures tokenizing, not handing out.
DRAWS = 200 if FULL else 300


def _corpus(path: Path, n_bytes: int) -> list[str]:
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, size=rng.integers(1, 9))) for _ in range(5000)]
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    docs, size = [], 0
    with open(path, "w") as f:
        while size < n_bytes:
            n = int(rng.integers(20, 400))
            text = " ".join(words[i] for i in rng.choice(len(words), size=n, p=p)) + "."
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            docs.append(text)
            size += len(line)
    return docs


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer, np.ndarray]:
    """The JSONL corpus, its tokenizer and the whole corpus tokenized (the token file)."""
    path = tmp_path_factory.mktemp("stream") / "corpus.jsonl"
    docs = _corpus(path, MB << 20)
    tok = train_bpe(docs[:400], VOCAB, show_progress=False)
    ids = [i for d in tok.encode_batch(docs) for i in [*d, tok.eos_id]]
    return path, tok, np.asarray(ids, dtype=np.uint16)


def _rate(benchmark, draw) -> None:
    benchmark.pedantic(draw, rounds=5 if FULL else 3, warmup_rounds=1)
    if benchmark.stats:
        benchmark.extra_info["tokens_per_s"] = DRAWS * BATCH * BLOCK / benchmark.stats.stats.median


@pytest.mark.benchmark(group="streaming-vs-token-file")
@pytest.mark.parametrize("workers", [2, 0])
def test_stream_sampler(benchmark, prepared, workers: int) -> None:
    path, tok, _ = prepared
    sampler = StreamSampler(
        [path], fmt="jsonl", tokenizer=tok, block_size=BLOCK, num_workers=workers
    )

    def draw() -> None:
        for _ in range(DRAWS):
            x, _ = sampler.next_batch(BATCH)
        assert x.shape == (BATCH, BLOCK)

    try:
        _rate(benchmark, draw)
    finally:
        sampler.close()


@pytest.mark.benchmark(group="streaming-vs-token-file")
def test_token_file(benchmark, prepared) -> None:
    _, _, ids = prepared
    sampler = BlockSampler(ids, BLOCK, seed=0)

    def draw() -> None:
        for _ in range(DRAWS):
            x, _ = sampler.next_batch(BATCH)
        assert x.shape == (BATCH, BLOCK)

    _rate(benchmark, draw)
