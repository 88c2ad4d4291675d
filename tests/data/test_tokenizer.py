"""Tokenizers: byte-level BPE and char, round trips, save/load, build_tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmkit.data.tokenizer import Tokenizer, build_tokenizer, take_bytes, train_bpe, train_char
from llmkit.errors import LlmkitError
from llmkit.spec import TokenizerSpec

CORPUS = [
    "def add(x, y):\n    return x + y\n",
    "class Foo:\n\tpass\n",
    "The quick brown fox jumps over the lazy dog.\n" * 5,
    "naïve café — 東京 🚀\n",
] * 20
SPECIALS = ["<|endoftext|>", "<|pad|>"]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe(CORPUS, 300, SPECIALS, min_frequency=2)


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "naïve café — 東京 🚀\n\tx",
        "   leading spaces",
        "trailing spaces   ",
        "\n\n\ttabs\tand\r\nnewlines\n",
        "unseen: Ωmega ∑ 👩‍👩‍👧 \x00\x7f",
        "",
        "a<|endoftext|>b",
    ],
)
def test_bpe_round_trip(bpe: Tokenizer, text: str) -> None:
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_vocab_and_specials(bpe: Tokenizer) -> None:
    assert bpe.kind == "bpe"
    assert 256 + len(SPECIALS) <= bpe.vocab_size <= 300
    assert bpe.special_tokens == {"<|endoftext|>": 0, "<|pad|>": 1}
    assert bpe.eos_id == 0
    assert bpe.encode("<|endoftext|>") == [0]
    assert max(max(bpe.encode_batch(CORPUS))) < bpe.vocab_size
    assert bpe.encode_batch(["ab", "cd"]) == [bpe.encode("ab"), bpe.encode("cd")]


def test_bpe_merges_learned(bpe: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog.\n"
    assert len(bpe.encode(text)) < len(text.encode("utf-8"))


def test_bpe_vocab_too_small() -> None:
    with pytest.raises(LlmkitError, match="at least 257"):
        train_bpe(CORPUS, 100, ["<|endoftext|>"])


def test_save_load_identical(bpe: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "sub" / "tokenizer.json"
    bpe.save(path)
    assert path.is_file() and not list(path.parent.glob(".*tmp"))
    again = Tokenizer.load(path)
    assert again.kind == "bpe" and again.vocab_size == bpe.vocab_size
    assert again.eos_id == bpe.eos_id
    assert again.encode_batch(CORPUS) == bpe.encode_batch(CORPUS)
    assert Tokenizer.load(tmp_path / "sub").vocab_size == bpe.vocab_size  # a directory


def test_char_tokenizer(tmp_path: Path) -> None:
    text = "hello world\nthe end.\n"
    tok = train_char([text], ["<|endoftext|>"])
    chars = sorted(set(text))
    assert tok.kind == "char"
    assert [tok.encode(c)[0] for c in chars] == list(range(len(chars)))  # nanoGPT's stoi
    assert tok.eos_id == len(chars)
    assert tok.vocab_size == len(chars) + 2  # + <|endoftext|> + <unk>
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("  \n") == [chars.index(" "), chars.index(" "), chars.index("\n")]
    unk = tok.token_to_id("<unk>")
    assert unk == len(chars) + 1
    assert tok.encode("hez") == [chars.index("h"), chars.index("e"), unk]
    assert tok.encode("h<|endoftext|>") == [chars.index("h"), tok.eos_id]

    tok.save(tmp_path / "char.json")
    again = Tokenizer.load(tmp_path / "char.json")
    assert again.kind == "char" and again.eos_id == tok.eos_id
    assert again.encode(text + "z") == tok.encode(text + "z")


def test_unknown_characters_are_counted(tmp_path: Path, bpe: Tokenizer) -> None:
    tok = train_char(["hello"], ["<|endoftext|>"])
    assert tok.unk_id == tok.token_to_id("<unk>")
    ids = tok.encode("hé<|endoftext|>llo wörld")
    assert tok.count_unknown(ids) == 6  # é, space, w, ö, r, d; not the special token
    assert tok.unknown_note(ids, "the prompt") == (
        "6 characters of the prompt are not in the tokenizer's vocabulary and became <unk>"
    )
    assert tok.unknown_note(tok.encode("hello"), "x") is None
    tok.save(tmp_path / "char.json")
    assert Tokenizer.load(tmp_path / "char.json").count_unknown(ids) == 6
    assert bpe.unk_id is None  # byte-level BPE reads any text
    assert bpe.count_unknown(bpe.encode("hé wörld")) == 0


def test_char_tokenizer_empty_corpus() -> None:
    with pytest.raises(LlmkitError, match="no text"):
        train_char(["", ""], [])


def test_take_bytes() -> None:
    assert list(take_bytes(["abc", "def"], None)) == ["abc", "def"]
    assert list(take_bytes(["abc", "def", "ghi"], 5)) == ["abc", "de"]
    assert "".join(take_bytes(["ééé"], 3)) == "é"  # never a broken character


def _counting(texts: list[str]):
    calls = []

    def factory():
        calls.append(1)
        return iter(texts)

    return factory, calls


def test_build_tokenizer_trains_then_reuses(tmp_path: Path) -> None:
    out = tmp_path / "tokenizer.json"
    spec = TokenizerSpec(kind="bpe", vocab_size=280)
    texts, calls = _counting(CORPUS)
    tok = build_tokenizer(spec, texts, out, default_vocab=50304)
    assert out.is_file() and tok.vocab_size <= 280 and len(calls) == 1
    mtime = out.stat().st_mtime_ns
    again = build_tokenizer(spec, texts, out, default_vocab=50304)
    assert len(calls) == 1  # not trained again
    assert out.stat().st_mtime_ns == mtime
    assert again.to_str() == tok.to_str()


def test_build_tokenizer_default_vocab_and_cap(tmp_path: Path) -> None:
    spec = TokenizerSpec(kind="bpe", train_bytes=100)
    tok = build_tokenizer(spec, lambda: iter(CORPUS), tmp_path / "t.json", default_vocab=400)
    assert tok.vocab_size <= 400
    spec = TokenizerSpec(kind="char", train_bytes=5)
    tok = build_tokenizer(spec, lambda: iter(["abcdefgh"]), tmp_path / "c.json", 0)
    assert tok.vocab_size == 5 + 2  # a..e, eos, unk


def test_build_tokenizer_kind_mismatch(tmp_path: Path) -> None:
    out = tmp_path / "tokenizer.json"
    build_tokenizer(TokenizerSpec(kind="char"), lambda: iter(["abc"]), out, 0)
    with pytest.raises(LlmkitError, match="char tokenizer"):
        build_tokenizer(TokenizerSpec(kind="bpe"), lambda: iter(["abc"]), out, 300)


def test_build_tokenizer_pretrained(bpe: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "pre.json"
    bpe.save(path)
    out = tmp_path / "run" / "tokenizer.json"
    spec = TokenizerSpec(path=str(path), special_tokens=["<|pad|>"])
    tok = build_tokenizer(spec, lambda: pytest.fail("must not train"), out, 50304)
    assert tok.kind == "pretrained"
    assert tok.eos_id == 1  # the spec's first special token, found in the vocabulary
    assert tok.encode_batch(CORPUS) == bpe.encode_batch(CORPUS)
    assert Tokenizer.load(out).encode_batch(CORPUS) == bpe.encode_batch(CORPUS)  # a copy


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(LlmkitError, match="not found"):
        Tokenizer.load(tmp_path / "nope.json")
    spec = TokenizerSpec(path=str(tmp_path / "nope.json"))
    with pytest.raises(LlmkitError, match="not found"):
        build_tokenizer(spec, lambda: iter([]), tmp_path / "t.json", 300)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "nonsense"}))
    with pytest.raises(LlmkitError, match="not a valid tokenizer"):
        Tokenizer.load(bad)


@pytest.mark.parametrize("specials", [[], ["<|endoftext|>", "<pad>"], ["§"]])
def test_char_table_equals_the_tokenizer(specials: list[str]) -> None:
    import random

    rng = random.Random(0)
    alphabet = "abcdefgh \n\tXYZ.,é☃😀§"
    tok = train_char(["".join(rng.choice(alphabet[:12]) for _ in range(200))], specials)
    table = tok.char_table()
    assert table is not None
    for _ in range(50):  # known, unknown, astral and special characters mixed
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 80)))
        ids = table.encode(text)
        assert ids is not None and ids.tolist() == tok.encode(text)
    with_special = "ab<|endoftext|>cd"
    if "<|endoftext|>" in specials:
        assert table.encode(with_special) is None  # left to the tokenizer
    else:
        assert table.encode(with_special).tolist() == tok.encode(with_special)


def test_char_table_only_for_char_tokenizers(bpe: Tokenizer) -> None:
    assert bpe.char_table() is None


def test_encoder_mixes_table_and_tokenizer() -> None:
    from llmkit.data.prepare import _Encoder

    tok = train_char(["hello world"], ["<|endoftext|>"])
    docs = ["hello", "", "he<|endoftext|>llo", None, "wörld"]
    out = _Encoder(tok.to_str(), tok.eos_id)(docs)
    eos = [tok.eos_id]
    expected = [tok.encode(d) + eos if d else [] for d in docs]
    assert [list(map(int, ids)) for ids in out["ids"]] == expected
    assert out["n_bytes"] == [5, 0, 18, 0, 6]
