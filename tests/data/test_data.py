"""Data preparation (token files, caching) and batching (BlockSampler, eval_batches)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from llmkit.data import (
    BlockSampler,
    TokenFile,
    eval_batches,
    prepare_data,
    token_dtype,
    write_token_file,
)
from llmkit.data import prepare as data_prepare
from llmkit.errors import LlmkitError
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

TEXT = "".join(f"line {i}: the cat sat on the mat, naïve café 東京\n" for i in range(400))


def make_rs(
    paths: list[Path], tokenizer: dict[str, Any] | None = None, vocab: int = 512, **data: Any
) -> Any:
    spec = tiny_spec(vocab_size=vocab)
    spec["tokenizer"] = tokenizer or {"kind": "char"}
    src = data.pop("source", {})
    spec["data"] = {"source": {"name": "text", "paths": [str(p) for p in paths], **src}, **data}
    return load_spec_dict(spec)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def quiet(_msg: str) -> None:
    pass


def split_docs(tokens: np.ndarray, tok: Any) -> list[str]:
    """Decode a token file back into its documents (EOS-separated)."""
    ids = tokens.tolist()
    assert ids[-1] == tok.eos_id
    docs, cur = [], []
    for i in ids:
        if i == tok.eos_id:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    return docs


# -- prepare_data ----------------------------------------------------------------------------


def test_prepare_char(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    logs: list[str] = []
    pd = prepare_data(make_rs([corpus]), run, log=logs.append)
    tok = pd.tokenizer
    assert tok.kind == "char" and (run / "tokenizer.json").is_file()
    cut = int(len(TEXT) * 0.9)
    assert split_docs(pd.train.array, tok) == [TEXT[:cut]]
    assert split_docs(pd.validation.array, tok) == [TEXT[cut:]]
    assert pd.train.dtype == np.uint16 and pd.train.path.suffix == ".bin"
    assert pd.train.path.parent == run / "data"
    assert len(pd.train) == cut + 1
    assert pd.train.n_bytes_text == len(TEXT[:cut].encode("utf-8"))
    assert pd.validation.n_bytes_text == len(TEXT[cut:].encode("utf-8"))
    assert pd.train.n_documents == 1
    assert "text: 1 file(s)" in pd.source_description
    assert any("train" in line for line in logs)
    assert not list((run / "data").glob("*.arrow"))  # the map cache is gone once written
    assert not list((run / "data").glob(".*"))  # no temp files left


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), OSError("os error 28")])
def test_a_full_disk_while_tokenizing_leaves_no_partial_cache(
    corpus: Path, tmp_path: Path, monkeypatch, error: OSError
) -> None:
    import datasets

    def full_disk(self, *args, cache_file_name=None, **kwargs):
        Path(cache_file_name).write_bytes(b"partial")  # what datasets had written so far
        raise error

    monkeypatch.setattr(datasets.Dataset, "map", full_disk)
    run = tmp_path / "run"
    with pytest.raises(LlmkitError, match=r"no space left on device writing .*\.arrow") as info:
        prepare_data(make_rs([corpus]), run, log=lambda _m: None)
    assert "\n" not in str(info.value)
    assert not list((run / "data").glob("*.arrow"))


def test_prepare_bpe_round_trip(tmp_path: Path) -> None:
    files = []
    for i in range(6):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(f"document {i}\n\tdef f(x):\n  return 'é🚀' * {i}\n" * 30)
    rs = make_rs(
        [tmp_path / "doc*.txt"],
        {"kind": "bpe", "vocab_size": 300},
        source={"split": "file", "val_fraction": 0.3},
    )
    pd = prepare_data(rs, tmp_path / "run", log=quiet)
    assert pd.tokenizer.kind == "bpe" and pd.tokenizer.vocab_size <= 300
    docs = split_docs(pd.train.array, pd.tokenizer) + split_docs(pd.validation.array, pd.tokenizer)
    assert sorted(docs) == sorted(f.read_text() for f in files)
    assert len(pd.train) < sum(len(d.encode()) for d in docs)  # merges compress


def test_prepare_reuses_token_files(corpus: Path, tmp_path: Path, monkeypatch) -> None:
    rs = make_rs([corpus])
    first = prepare_data(rs, tmp_path / "run", log=quiet)
    mtimes = {p: p.stat().st_mtime_ns for p in (first.train.path, first.validation.path)}

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data_prepare, "tokenize_split", boom)
    second = prepare_data(rs, tmp_path / "run", log=quiet)
    assert second.train.path == first.train.path and second.key == first.key
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    assert np.array_equal(second.train.array, first.train.array)
    assert second.train.n_bytes_text == first.train.n_bytes_text


def test_cache_dir_expands_the_home_directory(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    prepared = prepare_data(make_rs([corpus], cache_dir="~/cache"), tmp_path / "run", log=quiet)
    assert prepared.train.path.parent == tmp_path / "home" / "cache"
    assert not (tmp_path / "~").exists()


def test_prepare_key_changes_with_source_and_tokenizer(corpus: Path, tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    a = prepare_data(make_rs([corpus], cache_dir=cache), tmp_path / "r1", log=quiet)
    # another run, same source and (retrained, identical) tokenizer: the shared cache is reused
    b = prepare_data(make_rs([corpus], cache_dir=cache), tmp_path / "r2", log=quiet)
    assert b.key == a.key
    c = prepare_data(
        make_rs([corpus], {"kind": "bpe", "vocab_size": 270}, cache_dir=cache),
        tmp_path / "r3",
        log=quiet,
    )
    assert c.key != a.key
    d = prepare_data(
        make_rs([corpus], cache_dir=cache, source={"val_fraction": 0.2}), tmp_path / "r1", log=quiet
    )
    assert d.key != a.key and len(d.validation) > len(a.validation)
    corpus.write_text(TEXT + "more\n", encoding="utf-8")  # edited data: a fresh file
    e = prepare_data(make_rs([corpus], cache_dir=cache), tmp_path / "r1", log=quiet)
    assert e.key != a.key
    assert len(list(Path(cache).glob("train-*.bin"))) == 4


def test_prepare_num_proc_same_tokens(tmp_path: Path) -> None:
    for i in range(8):
        (tmp_path / f"f{i}.txt").write_text(f"file {i} " * 50 + "\n")
    one = prepare_data(make_rs([tmp_path / "*.txt"]), tmp_path / "a", log=quiet)
    two = prepare_data(make_rs([tmp_path / "*.txt"], num_proc=2), tmp_path / "b", log=quiet)
    assert np.array_equal(one.train.array, two.train.array)
    assert two.train.n_documents == 8 and two.train.n_bytes_text == one.train.n_bytes_text


def test_prepare_given_tokenizer(corpus: Path, tmp_path: Path) -> None:
    from llmkit.data.tokenizer import train_char

    tok = train_char([TEXT + "xyz"], ["<|endoftext|>"])
    pd = prepare_data(make_rs([corpus]), tmp_path / "run", tokenizer=tok, log=quiet)
    assert pd.tokenizer is tok
    assert not (tmp_path / "run" / "tokenizer.json").exists()
    assert int(pd.train.array[-1]) == tok.eos_id


def test_prepare_empty_corpus(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("".join(json.dumps({"text": ""}) + "\n" for _ in range(10)))
    spec = tiny_spec(vocab_size=512)
    spec["tokenizer"] = {"kind": "bpe", "vocab_size": 300}
    spec["data"] = {"source": {"name": "jsonl", "paths": [str(path)], "cache_dir": str(tmp_path)}}
    with pytest.raises(LlmkitError, match="no text"):
        prepare_data(load_spec_dict(spec), tmp_path / "run", log=quiet)


def test_corpus_shorter_than_block(tmp_path: Path) -> None:
    small = tmp_path / "small.txt"
    small.write_text("tiny corpus\n" * 3)
    pd = prepare_data(make_rs([small]), tmp_path / "run", log=quiet)
    with pytest.raises(LlmkitError, match=r"corpus shorter than one block: \d+ tokens < block"):
        BlockSampler(pd.train, 64, seed=0)
    with pytest.raises(LlmkitError, match="shorter than one block"):
        next(eval_batches(pd.validation, 64, 2, 2))


# -- token files ----------------------------------------------------------------------------


def test_token_dtype_and_files(tmp_path: Path) -> None:
    assert token_dtype(300) == np.uint16 and token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint32 and token_dtype(200_000) == np.uint32
    ids = np.array([0, 70_000, 5, 199_999])
    tf = write_token_file([ids[:2], ids[2:]], tmp_path / "big.bin", token_dtype(200_000), {"x": 1})
    assert tf.dtype == np.uint32 and len(tf) == 4 and tf.meta["x"] == 1
    assert tf.array.tolist() == ids.tolist() and tf[1] == 70_000
    assert (tmp_path / "big.bin").stat().st_size == 16
    with pytest.raises(LlmkitError, match="does not fit"):
        write_token_file([ids], tmp_path / "small.bin", token_dtype(300), {})
    assert not (tmp_path / "small.bin").exists()
    again = pickle.loads(pickle.dumps(tf))
    assert again.array.tolist() == ids.tolist()
    empty = write_token_file([], tmp_path / "empty.bin", np.dtype(np.uint16), {})
    assert len(empty) == 0 and empty.array.size == 0
    with pytest.raises(LlmkitError, match="not found"):
        TokenFile(tmp_path / "missing.bin")


# -- BlockSampler -----------------------------------------------------------------------------


def draw(sampler: BlockSampler, k: int, batch: int) -> list[torch.Tensor]:
    return [sampler.next_batch(batch)[0] for _ in range(k)]


def test_sampler_blocks_and_targets() -> None:
    tokens = np.arange(1001, dtype=np.uint16)
    s = BlockSampler(tokens, 10, seed=0)
    assert s.n_blocks == 99 and s.tokens_per_epoch == 990  # one block kept spare
    x, y = s.next_batch(8)
    assert x.shape == y.shape == (8, 10) and x.dtype == y.dtype == torch.long
    assert torch.equal(y, x + 1)
    assert (x[:, 0] % 10 == 0).all()  # packed, non-overlapping blocks in the first epoch


def test_later_epochs_shift_the_block_grid() -> None:
    tokens = np.arange(1001)
    s = BlockSampler(tokens, 10, seed=5)
    shifts = {s.shift(e) for e in range(1, 30)}
    assert s.shift(0) == 0 and shifts <= set(range(11)) and len(shifts) > 3
    draw(s, 99, 1)  # the whole first epoch
    x, y = s.next_batch(99)  # the whole second epoch: one shared offset
    starts = x[:, 0]
    assert len(set((starts % 10).tolist())) == 1 and int(starts[0] % 10) == s.shift(1) % 10
    assert len(set(starts.tolist())) == 99 and int(y.max()) <= 1000  # disjoint, in bounds


def test_sampler_deterministic_and_epochs() -> None:
    tokens = np.arange(101)
    a, b = BlockSampler(tokens, 10, seed=3), BlockSampler(tokens, 10, seed=3)
    assert all(torch.equal(u, v) for u, v in zip(draw(a, 5, 3), draw(b, 5, 3)))
    other = BlockSampler(tokens, 10, seed=4)
    assert not all(torch.equal(u, v) for u, v in zip(draw(other, 5, 3), draw(b, 5, 3)))

    s = BlockSampler(tokens, 10, seed=1)  # 9 blocks (one spare)
    first = torch.cat(draw(s, 2, 4))[:, 0] // 10  # 8 blocks of epoch 0
    assert s.state_dict() == {"epoch": 0, "index": 8, "world_size": 1}
    last_and_next = s.next_batch(3)[0][:, 0]  # 1 from epoch 0, 2 from epoch 1
    assert s.state_dict() == {"epoch": 1, "index": 2, "world_size": 1}
    epoch0 = [*first.tolist(), int(last_and_next[0]) // 10]
    assert sorted(epoch0) == list(range(9))
    assert epoch0 != sorted(epoch0)
    epoch1 = list(s.order(1))
    assert ((last_and_next[1:] - s.shift(1)) // 10).tolist() == epoch1[:2]
    assert epoch1 != epoch0


def test_sampler_resume_continues_exactly() -> None:
    tokens = np.arange(5001)
    original = BlockSampler(tokens, 16, seed=11)
    draw(original, 7, 10)  # 70 blocks drawn, crossing into the next epoch
    state = original.state_dict()
    assert all(type(v) is int for v in state.values())
    restored = BlockSampler(tokens, 16, seed=11)
    restored.load_state_dict(json.loads(json.dumps(state)))
    for u, v in zip(draw(original, 40, 10), draw(restored, 40, 10)):
        assert torch.equal(u, v)
    with pytest.raises(LlmkitError, match="sampler state"):
        restored.load_state_dict({"epoch": 0, "index": 10_000})


def test_sampler_sharding_disjoint() -> None:
    tokens = np.arange(1001)
    ranks = [BlockSampler(tokens, 10, seed=5, rank=r, world_size=2) for r in range(2)]
    assert [r.blocks_per_rank for r in ranks] == [49, 49]  # 99 blocks, one spare
    seen = [set((torch.cat(draw(r, 7, 7))[:, 0] // 10).tolist()) for r in ranks]
    assert len(seen[0]) == len(seen[1]) == 49
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] <= set(range(99))
    assert not set(ranks[0].order(1)) & set(ranks[1].order(1))
    with pytest.raises(LlmkitError, match="ranks"):
        BlockSampler(np.arange(25), 10, world_size=3)


def _starts(sampler: BlockSampler, batch: int) -> list[int]:
    return sampler.next_batch(batch)[0][:, 0].tolist()


def test_ranks_in_lockstep_read_what_one_process_reads_with_the_global_batch() -> None:
    tokens = np.arange(1201)  # 119 blocks used by one process, 2 × 59 by two ranks
    single = BlockSampler(tokens, 10, seed=3)
    ranks = [BlockSampler(tokens, 10, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(14):  # 14 steps of a global batch of 8: 112 of the epoch's 118 blocks
        want = sorted(_starts(single, 8))
        assert sorted(_starts(ranks[0], 4) + _starts(ranks[1], 4)) == want


def test_sampler_state_moves_between_world_sizes() -> None:
    tokens = np.arange(1001)  # 99 blocks used
    two = [BlockSampler(tokens, 10, seed=1, rank=r, world_size=2) for r in range(2)]
    for s in two:
        s.next_batch(6)  # 12 blocks done globally
    state = two[0].state_dict()
    assert state == {"epoch": 0, "index": 6, "world_size": 2}
    one = BlockSampler(tokens, 10, seed=1)
    one.load_state_dict(state)
    reference = BlockSampler(tokens, 10, seed=1)
    reference.next_batch(12)
    assert torch.equal(one.next_batch(5)[0], reference.next_batch(5)[0])
    three = BlockSampler(tokens, 10, seed=1, rank=1, world_size=3)
    three.load_state_dict(state)
    assert three.index == 4


# -- eval_batches -----------------------------------------------------------------------------


def test_eval_batches_fixed_and_even() -> None:
    tokens = np.arange(10_001)
    a = list(eval_batches(tokens, 10, 4, 5))
    b = list(eval_batches(tokens, 10, 4, 5))
    assert len(a) == 5
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    starts = torch.cat([x for x, _ in a])[:, 0]
    assert torch.equal(a[0][1], a[0][0] + 1)
    assert starts[0] == 0 and starts[-1] == 9990  # spread over the whole file
    gaps = starts.diff()
    assert (gaps > 0).all() and gaps.max() - gaps.min() <= 10


def test_eval_batches_few_blocks() -> None:
    batches = list(eval_batches(np.arange(51), 10, 4, 10))
    assert [len(x) for x, _ in batches] == [4, 1]  # each of the 5 blocks once
    assert torch.cat([x for x, _ in batches])[:, 0].tolist() == [0, 10, 20, 30, 40]


def test_random_window_sampler_is_a_function_of_the_draw_count() -> None:
    from llmkit.data import RandomWindowSampler

    tokens = np.arange(500)
    a = RandomWindowSampler(tokens, 16, seed=2)
    batches = [a.next_batch(4) for _ in range(5)]
    for x, y in batches:
        assert torch.equal(y, x + 1) and int(y.max()) < 500
    starts = torch.cat([x[:, 0] for x, _ in batches])
    assert (starts % 16 != 0).any()  # not tied to a grid
    b = RandomWindowSampler(tokens, 16, seed=2)
    b.load_state_dict(json.loads(json.dumps({"draws": 3})))
    assert torch.equal(b.next_batch(4)[0], batches[3][0])
    with pytest.raises(LlmkitError, match="shorter than one block"):
        RandomWindowSampler(np.arange(10), 16)


def test_data_seed_fixes_the_split_whatever_the_training_seed(tmp_path: Path) -> None:
    files = []
    # each file's split is a coin flip keyed by its path: with 40 files two seeds agree on
    # all of them with probability 0.58^40 ≈ 3e-10 (12 files left a 1-in-700 flake)
    for i in range(40):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(f"document {i}: " + "abc " * 50)

    def validation(train_seed: int, data_seed: int | None) -> list[int]:
        rs = make_rs(files, source={"val_fraction": 0.3, "split": "file"}, seed=data_seed)
        rs = rs.with_settings({"train.seed": train_seed})
        run = tmp_path / f"run-{train_seed}-{data_seed}"
        return prepare_data(rs, run, log=quiet).validation.array.tolist()

    assert validation(1, 7) == validation(2, 7)  # one validation set for every seed
    assert validation(1, None) != validation(2, None)  # by default train.seed picks it


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_empty_documents_add_no_ids_and_shift_none(tmp_path, kind):
    import datasets

    from llmkit.data.tokenizer import train_bpe, train_char

    docs = ["alpha beta", "", "gamma delta", None, "epsilon zeta"]
    texts = [d for d in docs if d]
    tok = train_bpe(texts * 10, 300) if kind == "bpe" else train_char(texts)
    ds = datasets.Dataset.from_dict({"text": docs})
    tokens = data_prepare.tokenize_split(ds, tok, tmp_path / "train.bin")
    want = [i for t in texts for i in [*tok.encode(t), tok.eos_id]]
    assert tokens.array.tolist() == want
