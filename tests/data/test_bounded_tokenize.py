"""Long texts are tokenized in bounded pieces (``encode_long``): the pieces' ids equal one
call's for the tokenizers llmkit trains and the usual imported ones, memory stays far below
what one call over the whole text costs, and hostile chat records, tokenizer configs and BPE
vocabularies are refused in one line."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from llmkit.data.chat import MAX_CONVERSATION_CHARS, ChatEncoder
from llmkit.data.long_text import CHUNK_CHARS, encode_long, split_text
from llmkit.data.tokenizer import (
    Tokenizer,
    build_tokenizer,
    read_config,
    train_bpe,
    train_char,
)
from llmkit.errors import LlmkitError
from llmkit.spec import TokenizerSpec

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: Llama 3's pre-tokenizer regex (its tokenizer.json's Split pattern).
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def normal_text(n_chars: int, seed: int = 0) -> str:
    """Prose, code, numbers, punctuation, tabs, blank lines, CRLF and non-ASCII text."""
    rng = random.Random(seed)
    words = ["the", "model", "tokenizer's", "isn't", "l'été", "naïve", "東京", "🚀", "x1"]
    words += ["def", "f(x):", "return", "x+1", "3.14159", "2024-01-01", "—", "...", "α-β"]
    seps = [" ", " ", " ", "  ", "\n", "\n\n", "\t", ", ", ". ", ".\n", "\r\n", "<|im_end|>\n"]
    out: list[str] = []
    size = 0
    while size < n_chars:
        piece = rng.choice(words) + rng.choice(seps)
        out.append(piece)
        size += len(piece)
    return "".join(out)[:n_chars]


CORPUS = [normal_text(20_000, seed) for seed in range(5)]


def _trained(model, pre_tokenizer, trainer, normalizer=None, decoder=None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(model)
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    if decoder is not None:
        tok.decoder = decoder
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return Tokenizer(tok, "pretrained")


def imported(kind: str) -> Tokenizer:
    """Tokenizers shaped as the Hugging Face ones llmkit imports."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "llama3":  # Split(regex) + ByteLevel without its own regex
        pre = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        return _trained(models.BPE(), pre, trainer, decoder=decoders.ByteLevel())
    if kind == "metaspace":  # SentencePiece converted to a fast tokenizer
        trainer = trainers.BpeTrainer(
            vocab_size=600, special_tokens=["<unk>", *SPECIALS], show_progress=False
        )
        pre = pre_tokenizers.Metaspace(prepend_scheme="first")
        return _trained(models.BPE(unk_token="<unk>"), pre, trainer)
    if kind == "wordpiece":  # BERT
        trainer = trainers.WordPieceTrainer(
            vocab_size=600, special_tokens=["[UNK]", *SPECIALS], show_progress=False
        )
        return _trained(
            models.WordPiece(unk_token="[UNK]"),
            pre_tokenizers.BertPreTokenizer(),
            trainer,
            normalizer=normalizers.BertNormalizer(lowercase=True),
        )
    raise ValueError(kind)


@pytest.fixture(scope="module", params=["bpe", "char", "llama3", "metaspace", "wordpiece"])
def tokenizer(request) -> Tokenizer:
    if request.param == "bpe":
        return train_bpe(CORPUS, 600, SPECIALS, show_progress=False)
    if request.param == "char":
        return train_char(CORPUS, SPECIALS)
    return imported(request.param)


def one_call(tok: Tokenizer, text: str) -> list[int]:
    return tok.tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("chunk", [200, 333, 4096])
def test_pieces_encode_to_the_ids_of_one_call(tokenizer: Tokenizer, chunk: int) -> None:
    text = normal_text(60_000, seed=7)
    ids = encode_long(tokenizer, text, chunk)
    assert ids.dtype == np.int32
    assert ids.tolist() == one_call(tokenizer, text)


def test_encode_and_encode_batch_cut_long_texts_alike(tokenizer: Tokenizer) -> None:
    long = normal_text(CHUNK_CHARS * 3 + 17, seed=3)
    assert tokenizer.encode(long) == one_call(tokenizer, long)
    short = ["a b", "", normal_text(1000, seed=4)]
    assert tokenizer.encode_batch([*short, long]) == [
        one_call(tokenizer, t) for t in [*short, long]
    ]


def test_split_text_cuts_before_whitespace_never_inside_a_special_token() -> None:
    text = normal_text(50_000, seed=1)
    pieces = list(split_text(text, 500, SPECIALS))
    assert "".join(pieces) == text
    assert all(len(p) <= 500 for p in pieces)
    for before, after in itertools.pairwise(pieces):
        assert after[0] == " " and not before[-1].isspace()
    # no whitespace at all: a hard cut, but never inside a special token nor off a mark
    hard = ("ab<|im_start|>cd" + "e\u0301") * 1000
    pieces = list(split_text(hard, 100, SPECIALS))
    assert "".join(pieces) == hard and all(len(p) <= 100 for p in pieces)
    for piece in pieces:
        assert piece.count("<") == piece.count("<|im_start|>")
        assert not piece.startswith("\u0301")
    assert list(split_text("", 10)) == []


def test_a_tokenizer_with_encode_only_is_cut_too() -> None:
    class Words:
        def encode(self, text: str) -> list[int]:
            return [len(w) for w in text.split()]

    text = normal_text(20_000, seed=2)
    assert encode_long(Words(), text, 256).tolist() == [len(w) for w in text.split()]


def test_unknown_characters_are_counted_in_an_array() -> None:
    tok = train_char(["abc "], SPECIALS)
    ids = encode_long(tok, "abcxyz " * 20_000, 1000)
    assert tok.count_unknown(ids) == 3 * 20_000 == tok.count_unknown(ids.tolist())


MEASURE = """
import resource, sys, time
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, {root!r})
from tests.data.test_bounded_tokenize import normal_text
from llmkit.data.tokenizer import train_bpe
from llmkit.evaluation.perplexity import file_text

tok = train_bpe([normal_text(300_000, seed=9)], 1000, ["<|endoftext|>"], show_progress=False)
path = Path({path!r})
path.write_text(normal_text({size}, seed=11), encoding="utf-8")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
text = file_text(SimpleNamespace(tokenizer=tok), path)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(grew // 1024, text.tokens.numel(), round(time.perf_counter() - start, 2))
"""


def test_a_long_eval_file_is_tokenized_in_bounded_memory(tmp_path: Path) -> None:
    """An 8 MB ``--data`` file: one ``tokenizers`` call over it peaks at ≈ 1.4 GB (170–400
    bytes per character); in pieces, with the text, ids and counts, well under 300 MB."""
    size = 8_000_000
    code = MEASURE.format(
        root=str(Path(__file__).parents[2]), path=str(tmp_path / "d.txt"), size=size
    )
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    grew_mib, tokens, _seconds = out.stdout.split()
    assert int(tokens) > size // 8
    assert int(grew_mib) < 300, f"peak RSS grew by {grew_mib} MiB tokenizing {size:,} bytes"


# -- hostile records and configs ----------------------------------------------------------------


def chat_encoder(tok: Tokenizer) -> ChatEncoder:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    return ChatEncoder(tok.to_str(), template, tok.template_tokens(), True)


def test_a_deeply_nested_conversation_is_one_line_naming_its_record() -> None:
    encoder = chat_encoder(train_char(["<>usera\n"], SPECIALS))
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(LlmkitError, match=r"^chat\.jsonl:7: invalid JSON: nested too deeply$"):
        encoder([deep], ["chat.jsonl:7"])


def test_a_conversation_over_the_limit_is_refused_naming_its_record() -> None:
    encoder = chat_encoder(train_char(["<>useristant\nab"], SPECIALS))
    big = [
        {"role": "user", "content": "a" * MAX_CONVERSATION_CHARS},
        {"role": "assistant", "content": "b"},
    ]
    with pytest.raises(LlmkitError, match=r"^chat\.jsonl:3: the conversation holds 4,194,305 "):
        encoder([json.dumps(big)], ["chat.jsonl:3"])
    fine = [{"role": "user", "content": "a" * 100_000}, {"role": "assistant", "content": "b"}]
    out = encoder([json.dumps(fine)], ["chat.jsonl:4"])
    assert sum(out["mask"][0]) == len("<assistant>b\n")  # the assistant's turn only


def test_a_deeply_nested_tokenizer_config_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer_config.json"
    path.write_text('{"chat_template": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(LlmkitError, match=r"tokenizer_config\.json: invalid JSON: nested too"):
        read_config(path)


@pytest.mark.parametrize(
    ("vocab", "key"), [({"vocab_size": 258}, "tokenizer.vocab_size"), ({}, "model.vocab_size")]
)
def test_a_bpe_vocabulary_too_small_names_the_spec_file_and_key(
    tmp_path: Path, vocab: dict, key: str
) -> None:
    spec = TokenizerSpec(kind="bpe", special_tokens=SPECIALS, **vocab)
    message = (
        rf"^specs/chat\.toml: {key}: 258 is too small for byte-level BPE: it needs at least 259 "
        r"\(256 bytes \+ 3 special tokens: <\|endoftext\|>, <\|im_start\|>, <\|im_end\|>\)$"
    )
    with pytest.raises(LlmkitError, match=message):
        build_tokenizer(
            spec,
            lambda: pytest.fail("the corpus is read before the vocabulary is checked"),
            tmp_path / "tokenizer.json",
            258,
            source="specs/chat.toml",
        )
