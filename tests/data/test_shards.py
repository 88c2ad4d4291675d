"""Sharded token stores: ShardedTokens gives every sampler exactly the batches of one flat
TokenFile holding the same tokens (blocks across shard boundaries included), reads lazily,
and refuses corrupt shards and indexes that point outside the store in one line."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from llmkit.data import TokenFile, eval_batches, eval_rows, write_token_file
from llmkit.data import shards as shards_mod
from llmkit.data.samplers import BlockSampler, PaddedSampler, RandomWindowSampler
from llmkit.data.shards_open import open_store, read_index
from llmkit.data.shards_write import SplitInput, write_store
from llmkit.data.tokenizer import train_char
from llmkit.errors import LlmkitError

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 40))) for _ in range(n)]


def make_store(
    tmp: Path,
    docs: list[str] | None = None,
    *,
    shard_tokens: int = 997,
    layout: str = "llmkit",
    name: str = "store",
) -> Path:
    """A store of ``docs`` (default: 120 made-up documents), 1 in 10 held out, with a char
    tokenizer, in shards of ``shard_tokens`` ids."""
    docs = docs if docs is not None else corpus(120)
    train, val = docs[len(docs) // 10 :], docs[: len(docs) // 10]
    tok = train_char(docs)
    out = tmp / name
    inputs = {"train": SplitInput(lambda: iter(train)), "validation": SplitInput(lambda: iter(val))}
    write_store(
        inputs,
        tok,
        out,
        recipe={"source": "test"},
        description="made-up words",
        shard_tokens=shard_tokens,
        layout=layout,
        log=lambda _m: None,
    )
    return out


def flat_twin(store: Path, split: str, tmp: Path) -> TokenFile:
    """One TokenFile holding the split's tokens, with the store's EOS."""
    st = open_store(store, split)
    ids = np.concatenate([np.fromfile(s.path, st.dtype, offset=s.offset) for s in st.shards])
    meta = {"eos_id": st.meta["eos_id"]}
    return write_token_file([ids], tmp / f"{split}-flat.bin", st.dtype, meta)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="module")
def twins(store, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flat")
    return {s: (open_store(store, s), flat_twin(store, s, tmp)) for s in ("train", "validation")}


def same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_the_index_describes_fixed_size_shards_and_their_documents(store):
    index = read_index(store)
    shards = index["splits"]["train"]["shards"]
    assert len(shards) >= 3 and all(s["tokens"] == 997 for s in shards[:-1])
    assert 0 < shards[-1]["tokens"] <= 997
    st = open_store(store, "train")
    assert len(st) == sum(s["tokens"] for s in shards) == index["splits"]["train"]["tokens"]
    bounds = st.doc_bounds
    assert bounds[0] == 0 and bounds[-1] == len(st) and len(bounds) == 108 + 1
    eos = st.meta["eos_id"]
    assert all(st.array[int(e) - 1] == eos for e in bounds[1:])  # each document ends in EOS
    assert st.n_documents == 108 and st.n_bytes_text == sum(len(d) for d in corpus(120)[12:])
    assert st.bytes_per_token == pytest.approx(st.n_bytes_text / len(st))


@pytest.mark.parametrize("seed", [0, 3])
def test_packed_batches_equal_those_of_one_token_file(twins, seed):
    st, tf = twins["train"]
    a, b = BlockSampler(st, 31, seed), BlockSampler(tf, 31, seed)
    assert a.n_blocks == b.n_blocks
    for _ in range(3 * a.blocks_per_rank // 8 + 2):  # past the first epoch: shifted grids
        same(a.next_batch(8), b.next_batch(8))
    assert a.epoch >= 2
    crossing = [i for i in a.order(0) if (i * 31) // 997 != (i * 31 + 31) // 997]
    assert crossing  # some blocks run across a shard boundary


def test_random_and_padded_batches_equal_those_of_one_token_file(twins):
    st, tf = twins["train"]
    a, b = RandomWindowSampler(st, 40, 5), RandomWindowSampler(tf, 40, 5)
    for _ in range(10):
        same(a.next_batch(16), b.next_batch(16))
    st.layout = tf.layout = "padded"
    try:
        a, b = PaddedSampler(st, 40, 2), PaddedSampler(tf, 40, 2)
        assert np.array_equal(a.bounds, b.bounds) and a.truncated == b.truncated
        for _ in range(20):
            same(a.next_batch(4), b.next_batch(4))
        for layout in ("packed", "padded"):
            sv, tv = twins["validation"]
            assert np.array_equal(
                eval_rows(sv, 16, layout=layout), eval_rows(tv, 16, layout=layout)
            )
            ours = list(eval_batches(sv, 16, 4, 3, layout=layout))
            assert len(ours) == 3
            for x, y in zip(ours, eval_batches(tv, 16, 4, 3, layout=layout), strict=True):
                same(x, y)
    finally:
        st.layout = tf.layout = "packed"


def test_the_array_indexes_like_a_numpy_array_across_shards(twins):
    st, tf = twins["train"]
    a, ref = st.array, np.asarray(tf.array)
    assert len(a) == len(ref) and a.shape == ref.shape and a.dtype == ref.dtype
    rng = np.random.default_rng(0)
    for i in (0, 996, 997, 998, len(ref) - 1, -1, -998):
        assert a[i] == ref[i]
    for sl in (slice(990, 1010), slice(None, 5), slice(-7, None), slice(3, 2000, 7),
               slice(2000, 3, -5), slice(5, 5)):  # fmt: skip
        assert np.array_equal(a[sl], ref[sl]), sl
    scattered = rng.integers(0, len(ref), size=(6, 9))  # not rows of neighbours: memory maps
    assert np.array_equal(a[scattered], ref[scattered])
    one_d = rng.integers(-len(ref), len(ref), size=50)
    assert np.array_equal(a[one_d], ref[one_d])
    rows = np.array([990, 1990, 5])[:, None] + np.arange(20)
    assert np.array_equal(a[rows], ref[rows])
    assert np.array_equal(a.astype(np.int32), ref.astype(np.int32))
    assert np.array_equal(np.asarray(a), ref)
    with pytest.raises(IndexError):
        a[len(ref)]
    with pytest.raises(IndexError):
        a[np.array([0, len(ref)])]


def test_shards_open_only_when_read_and_are_checked_once_per_process(store, monkeypatch):
    hashed: list[str] = []
    real = shards_mod.file_sha256
    monkeypatch.setattr(
        shards_mod, "file_sha256", lambda p, o=0: hashed.append(Path(p).name) or real(p, o)
    )
    monkeypatch.setattr(shards_mod, "_verified", set())
    st = open_store(store, "train")
    assert hashed == [] and st._fds == [None] * len(st.shards)
    st.array[10:20]
    assert hashed == ["train-000000.bin"] and st._fds[1] is None
    st.array[990:1000]  # across the first boundary: the second shard opens
    assert hashed == ["train-000000.bin", "train-000001.bin"]
    again = pickle.loads(pickle.dumps(st))  # as a DataLoader worker gets it
    assert again._fds == [None] * len(st.shards)
    assert np.array_equal(again.array[985:1005], st.array[985:1005])
    assert len(hashed) == 2  # checked once in this process
    st.close()


def _entry(store: Path, k: int = 1) -> dict:
    return json.loads((store / "index.json").read_text())["splits"]["train"]["shards"][k]


def test_a_corrupt_shard_is_one_line_naming_it_when_first_read(tmp_path, monkeypatch):
    monkeypatch.setattr(shards_mod, "_verified", set())
    store = make_store(tmp_path)
    shard = store / "train-000001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    st = open_store(store, "train")
    st.array[:50]  # the first shard is whole
    with pytest.raises(LlmkitError, match=r"train-000001\.bin: checksum \(SHA-256\)") as err:
        st.array[1000:1010]
    assert "\n" not in str(err.value)
    shard.write_bytes(bytes(data[:-2]))  # truncated
    with pytest.raises(LlmkitError, match=r"train-000001\.bin: \d+ bytes, but the index says"):
        open_store(store, "train").array[1000:1010]


@pytest.mark.parametrize("name", ["../x.bin", "/etc/passwd", "sub/x.bin", ".."])
def test_an_index_pointing_outside_the_store_is_refused(tmp_path, name):
    store = make_store(tmp_path)
    index = json.loads((store / "index.json").read_text())
    index["splits"]["train"]["shards"][1]["file"] = name
    (store / "index.json").write_text(json.dumps(index))
    with pytest.raises(LlmkitError, match=r"index\.json: splits\.train\.shards\[1\]\.file") as err:
        open_store(store, "train")
    assert "\n" not in str(err.value)


def test_a_link_out_of_the_store_is_refused(tmp_path):
    store = make_store(tmp_path)
    outside = tmp_path / "elsewhere.bin"
    (store / "train-000001.bin").rename(outside)
    os.symlink(outside, store / "train-000001.bin")
    with pytest.raises(
        LlmkitError, match=r"shards\[1\]\.file: 'train-000001.bin' leads to .*outside"
    ):
        open_store(store, "train")


def test_ids_outside_the_tokenizer_and_unfinished_stores_are_refused(tmp_path):
    store = make_store(tmp_path)
    index = json.loads((store / "index.json").read_text())
    index["tokenizer"]["vocab_size"] = 3
    (store / "index.json").write_text(json.dumps(index))
    with pytest.raises(LlmkitError, match=r"train-000000\.bin: token id \d+ .* of 3 ids"):
        open_store(store, "train")
    index["complete"] = False
    (store / "index.json").write_text(json.dumps(index))
    with pytest.raises(LlmkitError, match="not complete"):
        open_store(store, "train")
    with pytest.raises(LlmkitError, match=r"no index\.json"):
        open_store(tmp_path, "train")


def test_a_replaced_store_tokenizer_is_refused(tmp_path):
    from llmkit.data.shards_open import _store_tokenizer

    store = make_store(tmp_path)
    run = tmp_path / "run"
    tok = _store_tokenizer(store, read_index(store), None, None, run)
    assert (run / "tokenizer.json").read_bytes() == (store / "tokenizer.json").read_bytes()
    assert tok.eos_id == open_store(store, "train").meta["eos_id"]
    train_char(["other text"]).save(store / "tokenizer.json")
    with pytest.raises(LlmkitError, match=r"tokenizer\.json: not the tokenizer the index names"):
        _store_tokenizer(store, read_index(store), None, None, tmp_path / "run2")
