"""Streamed data (llmkit.data.streaming): the readers and their positions, exact resume
with and without DataLoader workers, disjoint shares across ranks and workers, a
``datasets.IterableDataset`` source, the held-out validation, one-line errors and bounded
memory."""

from __future__ import annotations

import itertools
import json
import random
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from llmkit.data import stream_readers
from llmkit.data.stream_readers import (
    Range,
    boundary,
    plan_shards,
    read_pieces,
    split_held_out,
)
from llmkit.data.streaming import StreamSampler, merge_rank_states, validation_ids
from llmkit.data.tokenizer import Tokenizer, train_bpe, train_char
from llmkit.errors import LlmkitError

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 \n-.,"
TOK = train_char([ALPHABET])
EOS = TOK.eos_id
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


def make_docs(n: int, seed: int, start: int = 0, long_every: int = 7) -> list[str]:
    """Documents ``d<id> word word ...``, each id unique; one in ``long_every`` is long (many
    rows of a block; 0: none)."""
    rng = random.Random(seed)
    docs = []
    for i in range(start, start + n):
        long = long_every and i % long_every == long_every // 2
        words = rng.randint(600, 900) if long else rng.randint(1, 30)
        docs.append(f"d{i:04d} " + " ".join(rng.choice(WORDS) for _ in range(words)))
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[list[Path], list[str]]:
    """Three JSONL files (one with a blank line and an empty text) and all their documents."""
    files, docs = [], []
    for f in range(3):
        part = make_docs(25, seed=f, start=100 * f)
        path = write_jsonl(tmp_path / f"part{f}.jsonl", part)
        if f == 1:
            with open(path, "a") as fh:
                fh.write('\n{"text": ""}\n')
        files.append(path)
        docs += part
    return files, docs


@pytest.fixture
def light(tmp_path: Path) -> tuple[list[Path], list[str]]:
    """Three JSONL files of short documents (an epoch is a few hundred rows)."""
    docs = make_docs(75, seed=6, long_every=0)
    files = [write_jsonl(tmp_path / f"light{i}.jsonl", docs[i : i + 25]) for i in (0, 25, 50)]
    return files, docs


def draw(sampler: StreamSampler, n: int, batch: int = 3) -> tuple[list[Any], list[Any]]:
    """``n`` batches and the state after each."""
    out, states = [], []
    for _ in range(n):
        x, y = sampler.next_batch(batch)
        assert x.dtype == torch.int64 and x.shape == (batch, sampler._plan.block_size)
        assert torch.equal(x[:, 1:], y[:, :-1])
        out.append((x.clone(), y.clone()))
        states.append(json.loads(json.dumps(sampler.state_dict())))  # plain values only
    return out, states


def same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b)
    )


def sequence(batches: list[Any]) -> list[int]:
    """One lane's tokens back from its rows (each row's first token is the last one's end)."""
    seq: list[int] = []
    for x, y in batches:
        for row_x, row_y in zip(x.tolist(), y.tolist()):
            row = [*row_x, row_y[-1]]
            seq += row if not seq else row[1:]
    return seq


def documents(seq: list[int]) -> list[str]:
    """The whole documents of a token sequence (the text before each EOS)."""
    out, cur = [], []
    for t in seq:
        if t == EOS:
            out.append(TOK.decode(cur))
            cur = []
        else:
            cur.append(t)
    return out


# -- readers -----------------------------------------------------------------------------------


def test_jsonl_reader_positions(tmp_path: Path) -> None:
    docs = make_docs(12, seed=1, long_every=0)
    path = write_jsonl(tmp_path / "a.jsonl", docs)
    data = path.read_bytes()
    starts = [0, *[i + 1 for i, b in enumerate(data) if b == ord("\n")][:-1]]
    shard = Range(0, 0, len(data))
    pieces = list(read_pieces(path, "jsonl", shard, 0, "text"))
    assert [p[0] for p in pieces] == docs
    assert [p[1] for p in pieces] == starts and [p[2] for p in pieces] == [*starts[1:], len(data)]
    assert all(p[3] for p in pieces)  # a line is a whole document
    # from the start of line 3, and from a byte inside line 3: the next line start
    assert [p[0] for p in read_pieces(path, "jsonl", shard, starts[3], "text")] == docs[3:]
    assert boundary(path, "jsonl", starts[3] + 5, len(data)) == starts[4]
    assert boundary(path, "jsonl", starts[3], len(data)) == starts[3]
    # shards own the lines starting in them: together every line once
    shards = plan_shards([path], "jsonl", [shard], want=4, shard_bytes=len(data) // 3)
    got = [p[0] for s in shards for p in read_pieces(path, "jsonl", s, s.start, "text")]
    assert len(shards) >= 3 and got == docs


def test_text_reader_cuts_keep_the_ids_and_resume(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(stream_readers, "PIECE_BYTES", 200)
    rng = random.Random(3)
    text = "".join(
        rng.choice(WORDS) + rng.choice([" ", "  ", ". ", ",\n", "\n\n"]) for _ in range(900)
    )
    path = tmp_path / "book.txt"
    path.write_text(text)
    size = len(text.encode())
    pieces = list(read_pieces(path, "text", Range(0, 0, size), 0, "text"))
    assert len(pieces) > 20 and "".join(p[0] for p in pieces) == text
    assert [p[3] for p in pieces] == [False] * (len(pieces) - 1) + [True]  # one document
    for p in pieces[:-1]:
        assert text[len(text[: p[2]])] in " \n\t", "cut at a cut point"
    again = list(read_pieces(path, "text", Range(0, 0, size), pieces[7][1], "text"))
    assert again == pieces[7:]
    # the pieces' ids are the ids of the whole text (byte-level BPE)
    bpe = train_bpe([text], vocab_size=300)
    joined = [i for p in pieces for i in bpe.encode(p[0])]
    assert joined == bpe.encode(text)
    # a file longer than a shard: shards meet at cut points and cover the text once
    shards = plan_shards([path], "text", [Range(0, 0, size)], want=4)
    assert len(shards) == 4 and shards[0].start == 0 and shards[-1].end == size
    assert all(a.end == b.start for a, b in itertools.pairwise(shards))
    assert all(text[b.start] == " " or text[b.start] in "\n\t" for b in shards[1:])


def test_parquet_reader_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(30, seed=4, long_every=0)
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": docs, "n": list(range(30))}), path, row_group_size=10)
    assert stream_readers.size_of(path, "parquet") == 30
    shards = plan_shards([path], "parquet", [Range(0, 0, 30)], want=6)
    assert len(shards) == 6
    assert all(s.start // 10 == (s.end - 1) // 10 for s in shards)  # within a row group
    got = [p for s in shards for p in read_pieces(path, "parquet", s, s.start, "body")]
    assert [p[0] for p in got] == docs and [p[1] for p in got] == list(range(30))
    from_row = read_pieces(path, "parquet", Range(0, 10, 20), 14, "body")
    assert [p[0] for p in from_row] == docs[14:20]
    with pytest.raises(LlmkitError, match=r"a\.parquet: no column 'text' \(columns: body, n\)"):
        StreamSampler([path], fmt="parquet", tokenizer=TOK, block_size=8)
    sampler = StreamSampler([path], fmt="parquet", text_field="body", tokenizer=TOK,
                            block_size=16, lanes=1)  # fmt: skip
    seq = sequence(draw(sampler, 40, batch=8)[0])
    assert sorted(documents(seq)[:30]) == sorted(docs)


def test_a_malformed_jsonl_line_is_one_line_naming_file_and_line(tmp_path: Path) -> None:
    good = json.dumps({"text": "alpha beta"})
    cases = {
        "bad.jsonl": (f"{good}\n{good}\n{{not json\n", r"bad\.jsonl:3: invalid JSON"),
        "field.jsonl": (f'{good}\n{{"body": "x"}}\n', r"field\.jsonl:2: no field 'text'"),
        "list.jsonl": (f"\n{good}\n[1, 2]\n", r"list\.jsonl:3: not a JSON object"),
        "num.jsonl": ('{"text": 5}\n', r"num\.jsonl:1: field 'text' holds int, not text"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_text(content)
        sampler = StreamSampler([path], fmt="jsonl", tokenizer=TOK, block_size=4)
        with pytest.raises(LlmkitError, match=message) as err:
            sampler.next_batch(2)
        assert "\n" not in str(err.value)
        with pytest.raises(LlmkitError, match=message):
            validation_ids([path], fmt="jsonl", tokenizer=TOK)
    # from a DataLoader worker: the same one line
    sampler = StreamSampler([tmp_path / "bad.jsonl"], fmt="jsonl", tokenizer=TOK, block_size=4,
                            num_workers=1)  # fmt: skip
    with pytest.raises(LlmkitError, match=r"bad\.jsonl:3: invalid JSON") as err:
        sampler.next_batch(2)
    assert "\n" not in str(err.value)


# -- exact resume ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "text"])
def test_exact_resume_without_workers(tmp_path: Path, corpus, fmt: str, monkeypatch) -> None:
    monkeypatch.setattr(stream_readers, "PIECE_BYTES", 300)  # text: many pieces a document
    files, docs = corpus
    if fmt == "text":  # one document per file, some of them long
        files = []
        for i in range(0, len(docs), 15):
            files.append(tmp_path / f"doc{i}.txt")
            files[-1].write_text(" ".join(docs[i : i + 15]))
    kw = dict(fmt=fmt, tokenizer=TOK, block_size=16, seed=5, lanes=3, shard_bytes=700)
    sampler = StreamSampler(files, **kw)
    n = 60
    batches, states = draw(sampler, n)
    assert len({tuple(x.flatten().tolist()) for x, _ in batches}) == n
    order, shards = sampler._local._order, sampler._plan.shards

    def file_of(lane: list[int]) -> int:
        return shards[order(lane[0])[lane[1]]].file

    inside = crossed = 0
    for k in range(0, n - 1, 3):
        resumed = StreamSampler(files, **kw)
        resumed.load_state_dict(states[k])
        assert same(draw(resumed, min(8, n - k - 1))[0], batches[k + 1 : k + 9])
        lanes = states[k]["streams"][0]["lanes"]
        inside += any(lane[3] > 16 for lane in lanes)  # more than a row into a piece
        later = states[min(k + 8, n - 1)]["streams"][0]["lanes"]
        crossed += any(file_of(a) != file_of(b) for a, b in zip(lanes, later))
    assert inside and crossed  # resumed inside documents, and went on into other files
    assert len(shards) > len(files) and {s.file for s in shards} == set(range(len(files)))


def test_exact_resume_with_workers(corpus) -> None:
    files, _ = corpus
    kw = dict(fmt="jsonl", tokenizer=TOK, block_size=16, seed=2, lanes=2, num_workers=2)
    sampler = StreamSampler(files, **kw)
    batches, states = draw(sampler, 14)
    sampler.close()
    assert states[4]["next"] == 1  # the next batch is worker 1's: the order survives
    for k in (4, 9):
        resumed = StreamSampler(files, **kw)
        resumed.load_state_dict(states[k])
        assert same(draw(resumed, 13 - k)[0], batches[k + 1 :])
        resumed.close()
    # the workers' batches are those of readers run in this process
    local = [StreamSampler(files, **{**kw, "num_workers": 0}) for _ in range(2)]
    local[0]._plan = sampler._plan  # reader 0 of the 2-worker plan
    assert same(draw(local[0], 2)[0], batches[0:4:2])


def test_resume_is_refused_for_another_layout(corpus, tmp_path: Path) -> None:
    files, _ = corpus
    kw = dict(fmt="jsonl", tokenizer=TOK, block_size=16)
    one = StreamSampler(files, **kw)
    one.next_batch(2)
    state = one.state_dict()
    for other, message in [
        (dict(num_workers=2), r"saved by 1 rank\(s\) × 0 worker\(s\), this run has 1 × 2"),
        (dict(world_size=2), r"saved by 1 rank\(s\) × 0 worker\(s\), this run has 2 × 0"),
        (dict(seed=9), "changed since the checkpoint"),
    ]:
        with pytest.raises(LlmkitError, match=message):
            StreamSampler(files, **{**kw, **other}).load_state_dict(state)
    files[0].write_text(files[0].read_text() + json.dumps({"text": "more"}) + "\n")
    with pytest.raises(LlmkitError, match="changed since the checkpoint"):
        StreamSampler(files, **kw).load_state_dict(state)
    tiny = write_jsonl(tmp_path / "tiny.jsonl", ["alpha"])
    with pytest.raises(LlmkitError, match=r"1 shard\(s\) cannot be shared by 2 rank\(s\)"):
        StreamSampler([tiny], **kw, world_size=2)


# -- work division -----------------------------------------------------------------------------


def test_ranks_and_workers_read_disjoint_shares(light) -> None:
    files, docs = light
    kw = dict(fmt="jsonl", tokenizer=TOK, block_size=32, seed=1, lanes=1, world_size=2)
    seen: list[set[str]] = []
    for rank in range(2):
        sampler = StreamSampler(files, **kw, rank=rank, num_workers=2)
        plan = sampler._plan
        batches = draw(sampler, 60, batch=4)[0]
        sampler.close()
        for w in range(2):
            share = [plan.shards[i] for i in plan.shares[w]]
            pieces = (read_pieces(files[s.file], "jsonl", s, s.start, "text") for s in share)
            expect = [p[0] for one in pieces for p in one]
            first_epoch = documents(sequence(batches[w::2]))[: len(expect)]
            assert len(first_epoch) == len(expect) and sorted(first_epoch) == sorted(expect)
            seen.append(set(first_epoch))
    assert sum(len(s) for s in seen) == len(docs) and set().union(*seen) == set(docs)
    merged = merge_rank_states([StreamSampler(files, **kw, rank=r).state_dict() for r in (1, 0)])
    StreamSampler(files, **kw, rank=1).load_state_dict(merged)


def test_a_datasets_iterable_dataset_source(monkeypatch) -> None:
    import datasets

    docs = make_docs(40, seed=8, long_every=20)
    ds = datasets.Dataset.from_dict({"text": docs}).to_iterable_dataset(num_shards=2)
    kw = dict(fmt="dataset", tokenizer=TOK.to_str(), block_size=16)
    halves = []
    for rank in range(2):
        sampler = StreamSampler(ds, **kw, rank=rank, world_size=2)
        halves.append(documents(sequence(draw(sampler, 80, batch=8)[0]))[:20])
    assert set(halves[0]).isdisjoint(halves[1]) and set(halves[0] + halves[1]) == set(docs)
    sampler = StreamSampler(ds, **kw)
    batches, states = draw(sampler, 30)
    assert states[10]["streams"][0]["lanes"][0][4] is not None  # datasets' own state
    for by_state in (True, False):
        monkeypatch.setattr(stream_readers, "resumes_by_state", lambda _ds, b=by_state: b)
        for k in (0, 10, 21):
            resumed = StreamSampler(ds, **kw)
            resumed.load_state_dict(states[k])
            assert same(draw(resumed, 29 - k)[0], batches[k + 1 :])
    # two workers: datasets deals them its shards
    sampler = StreamSampler(ds, **kw, num_workers=2)
    batches = draw(sampler, 60, batch=16)[0]
    sampler.close()
    per_worker = [documents(sequence(batches[w::2]))[:20] for w in range(2)]
    assert sorted(per_worker[0] + per_worker[1]) == sorted(docs)
    with pytest.raises(LlmkitError, match=r"2 shard\(s\) per rank cannot feed 3 DataLoader"):
        StreamSampler(ds, **kw, num_workers=3)
    with pytest.raises(LlmkitError, match=r"needs a datasets\.IterableDataset"):
        StreamSampler(["a.jsonl"], **kw)
    val = validation_ids(ds, fmt="dataset", tokenizer=TOK, max_bytes=50)
    assert documents(val.tolist())[0] == docs[0]


# -- validation, memory ------------------------------------------------------------------------


def test_validation_is_the_held_out_tail(light, tmp_path: Path) -> None:
    files, docs = light
    kw = dict(fmt="jsonl", tokenizer=TOK, block_size=32, lanes=1, held_out=0.2)
    val = documents(validation_ids(files, fmt="jsonl", tokenizer=TOK, held_out=0.2).tolist())
    assert val == docs[-len(val) :] and 5 < len(val) < 25  # the corpus's tail, in order
    train = documents(sequence(draw(StreamSampler(files, **kw), 120, batch=4)[0]))
    assert set(train) == set(docs) - set(val)  # disjoint, and all the rest
    capped = validation_ids(files, fmt="jsonl", tokenizer=TOK, held_out=0.2, max_bytes=400)
    assert documents(capped.tolist()) == val[-len(documents(capped.tolist())) :]
    assert len(capped) < 500
    # val_paths: their start, up to max_bytes of text
    head = validation_ids(files[:1], fmt="jsonl", tokenizer=TOK, max_bytes=300)
    assert documents(head.tolist()) == docs[: len(documents(head.tolist()))]
    assert head.dtype == np.int32 and len(head) < 1000
    with pytest.raises(LlmkitError, match="give val_paths"):
        split_held_out([write_jsonl(tmp_path / "one.jsonl", ["alpha"])], "jsonl", 0.5, 100)


def test_memory_stays_bounded(tmp_path: Path) -> None:
    """A corpus of ~6 MB is never held: drawing batches peaks far below its size (each lane
    holds about one piece of text and its ids)."""
    line = json.dumps({"text": " ".join(["alpha beta gamma"] * 40)}) + "\n"
    big = tmp_path / "big.jsonl"
    big.write_text(line * 9000)
    book = tmp_path / "book.txt"
    book.write_text("the gamma delta epsilon " * 250_000)
    assert big.stat().st_size > 5e6 and book.stat().st_size > 5e6
    for path, fmt in [(big, "jsonl"), (book, "text")]:
        tracemalloc.start()
        sampler = StreamSampler(
            [path], fmt=fmt, tokenizer=TOK, block_size=64, held_out=0.01, lanes=2
        )
        for _ in range(20):
            sampler.next_batch(8)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1.5e6, f"{fmt}: peak {peak / 1e6:.1f} MB"


def test_a_tokenizer_as_json_and_eos(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["alpha", "beta"])
    as_json = StreamSampler([path], fmt="jsonl", tokenizer=TOK.to_str(), block_size=4, lanes=1)
    as_obj = StreamSampler([path], fmt="jsonl", tokenizer=TOK, block_size=4, lanes=1)
    assert same(draw(as_json, 3)[0], draw(as_obj, 3)[0])
    seq = sequence(draw(StreamSampler([path], fmt="jsonl", tokenizer=TOK, block_size=4), 2)[0])
    assert seq[:6] == [*TOK.encode("alpha"), EOS]
    assert isinstance(Tokenizer.from_str(TOK.to_str()).eos_id, int)
