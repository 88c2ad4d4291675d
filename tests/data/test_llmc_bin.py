"""llm.c / nanoGPT ``.bin`` shards: read past their 256-int32 header as one lazily opened
token sequence, written in the same format, refused in one line when broken."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from llmkit.data import shards as shards_mod
from llmkit.data.llmc import GPT2_EOS, read_header, read_llmc, write_llmc
from llmkit.data.samplers import BlockSampler
from llmkit.errors import LlmkitError
from tests.data.test_shards import make_store


def by_hand(path, ids, magic=20240520, version=1, fmt="<H"):
    """A .bin file from the documented format: 256 little-endian int32 (magic, version,
    token count, zeros), then each id."""
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", magic, version, len(ids), *([0] * 253)))
        for i in ids:
            f.write(struct.pack(fmt, i))
    return path


def test_a_file_written_by_hand_from_the_format_reads_back(tmp_path):
    ids = [GPT2_EOS, 15496, 11, 995, GPT2_EOS, 40, 716, 13, 65535]
    path = by_hand(tmp_path / "fineweb_train_000001.bin", ids)
    head = read_header(path)
    assert (head.magic, head.version, head.tokens, head.offset) == (20240520, 1, 9, 1024)
    tokens = read_llmc(path)
    assert len(tokens) == 9 and tokens.dtype == np.uint16
    assert tokens.array[:].tolist() == ids
    # GPT-2 data puts the EOS before each document: documents start there
    assert tokens.doc_bounds.tolist() == [0, 4, 9]
    wide = by_hand(tmp_path / "llama.bin", [128000, 5, 70000], 20240801, 7, "<I")
    assert read_llmc(wide, eos_id=None).array[:].tolist() == [128000, 5, 70000]


def test_our_writer_writes_the_documented_header(tmp_path):
    ids = np.arange(1000, dtype=np.int64) * 37 % 50257
    path = write_llmc(tmp_path / "a.bin", ids)
    raw = path.read_bytes()
    assert struct.unpack("<3i", raw[:12]) == (20240520, 1, 1000)
    assert raw[12:1024] == bytes(1012) and len(raw) == 1024 + 2000
    assert np.array_equal(np.frombuffer(raw[1024:], "<u2"), ids)
    big = write_llmc(tmp_path / "b.bin", [70000, 1], dtype="uint32")
    assert struct.unpack("<3i", big.read_bytes()[:12]) == (20240801, 7, 2)
    with pytest.raises(LlmkitError, match="do not fit uint16"):
        write_llmc(tmp_path / "c.bin", [70000])


def test_several_files_train_as_one_sequence(tmp_path):
    a = write_llmc(tmp_path / "t_000.bin", np.arange(0, 300) % 97)
    b = write_llmc(tmp_path / "t_001.bin", np.arange(300, 700) % 97)
    tokens = read_llmc([a, b], eos_id=None, vocab_size=97)
    flat = np.arange(700) % 97
    assert len(tokens) == 700 and np.array_equal(tokens.array[250:350], flat[250:350])
    ours, flat_sampler = BlockSampler(tokens, 64, 0), BlockSampler(flat, 64, 0)
    for _ in range(4):
        for got, want in zip(ours.next_batch(4), flat_sampler.next_batch(4), strict=True):
            assert torch.equal(got, want)


def test_broken_files_are_one_line_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(shards_mod, "_verified", set())
    cases = {
        "magic.bin": (struct.pack("<256i", 1234, 1, 0, *([0] * 253)), "not an llm.c magic"),
        "version.bin": (struct.pack("<256i", 20240520, 2, 0, *([0] * 253)), r"header\[1\]"),
        "short.bin": (struct.pack("<256i", 20240520, 1, 5, *([0] * 253)) + b"\0\0", "truncated"),
        "tiny.bin": (b"\0" * 10, "shorter than the 1024-byte"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(LlmkitError, match=message) as err:
            read_llmc(tmp_path / name)
        assert name in str(err.value) and "\n" not in str(err.value)
    big = write_llmc(tmp_path / "ids.bin", [1, 2, 300])
    tokens = read_llmc(big, vocab_size=256)  # headers only: nothing is read yet
    with pytest.raises(LlmkitError, match=r"ids\.bin: token id 300 is outside .* 256 ids"):
        tokens.array[0]


def test_headerless_nanogpt_files(tmp_path):
    ids = np.arange(500, dtype=np.uint16)
    ids.tofile(tmp_path / "train.bin")
    tokens = read_llmc(tmp_path / "train.bin", header=False, eos_id=None)
    assert np.array_equal(tokens.array[:], ids)
    with pytest.raises(LlmkitError, match=r"train\.bin: 1000 bytes, shorter than the 1024-byte"):
        read_llmc(tmp_path / "train.bin")  # not an llm.c file: header = false reads it


def test_a_store_in_llmc_format_is_read_by_an_llmc_reader(tmp_path):
    store = make_store(tmp_path, layout="llmc")
    names = sorted(p.name for p in store.glob("*.bin"))
    assert names[0] == "train_000000.bin" and names[-1].startswith("val_00000")
    from llmkit.data.shards_open import open_store

    ours = open_store(store, "train")
    theirs = read_llmc(sorted(store.glob("train_*.bin")), eos_id=None)
    assert len(theirs) == len(ours)
    assert np.array_equal(theirs.array[:], ours.array[:])
    assert np.array_equal(ours.doc_bounds, make_store_bounds(tmp_path))


def make_store_bounds(tmp_path):
    """The same corpus in the llmkit format has the same documents."""
    from llmkit.data.shards_open import open_store

    return open_store(make_store(tmp_path, name="plain"), "train").doc_bounds
