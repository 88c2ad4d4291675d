"""llmkit.interop.hf_tokenizer: Hugging Face tokenizers into runs and out again, with the
same ids as ``transformers`` (``add_special_tokens=False``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerFast

from llmkit.components.dataset.chat import CHATML
from llmkit.data.chat import render
from llmkit.data.tokenizer import CONFIG_FILE, Tokenizer, train_bpe, train_char
from llmkit.errors import LlmkitError
from llmkit.interop.hf_tokenizer import (
    read_hf_tokenizer,
    write_hf_tokenizer,
    write_run_tokenizer,
)

EOS, BOS = "<|endoftext|>", "<s>"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "héllo", "wörld"]
WORDS += ["日本語", "🙂", "tab\tend", "", "two", "  "]
SAMPLES = [
    "the quick brown fox",
    "  leading spaces and trailing  ",
    "héllo wörld 日本語 🙂 naïve café",
    "tabs\tand\nnewlines\r\n\n",
    f"{BOS}start of text{EOS}next document",
    "unseen: zqxj ÆØÅ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "",
]


def corpus(n: int = 300) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n)]


def tiny_bpe() -> RawTokenizer:
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fast HF tokenizer saved by transformers (tokenizer.json + tokenizer_config.json)."""
    d = tmp_path_factory.mktemp("hf")
    fast = PreTrainedTokenizerFast(tokenizer_object=tiny_bpe(), eos_token=EOS, bos_token=BOS)
    fast.save_pretrained(d)
    return d


def hf_ids(hf_tok, text: str) -> list[int]:
    return hf_tok(text, add_special_tokens=False)["input_ids"]


def assert_same_ids(llm: Tokenizer, hf_tok, samples=SAMPLES) -> None:
    for text in samples:
        assert llm.encode(text) == hf_ids(hf_tok, text), text


# -- import -----------------------------------------------------------------------------------


def test_import_fast_tokenizer_same_ids(hf_dir: Path, tmp_path: Path) -> None:
    files = read_hf_tokenizer(hf_dir)
    assert files is not None
    assert (files.eos_token, files.bos_token) == (EOS, BOS)
    assert files.special_tokens[:2] == [EOS, BOS]
    assert files.source == "tokenizer.json" and files.kind == "bpe"
    assert not files.adds_bos  # PreTrainedTokenizerFast adds nothing by default
    write_run_tokenizer(files, tmp_path)
    llm = Tokenizer.load(tmp_path / "tokenizer.json", eos_token=files.special_tokens[0])
    hf = AutoTokenizer.from_pretrained(hf_dir)
    assert_same_ids(llm, hf)
    assert llm.encode(EOS) == [hf.eos_token_id] and llm.eos_id == hf.eos_token_id
    assert llm.bos_token == BOS  # from the run's tokenizer_config.json, for a caller to prepend
    assert llm.end_of_turn == EOS
    for text in SAMPLES:
        assert llm.decode(llm.encode(text)) == hf.decode(hf_ids(hf, text))


def test_import_reads_added_token_dicts_and_special_tokens_map(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(tiny_bpe().to_str())
    bos = {"content": BOS, "lstrip": False, "normalized": False, "special": True}
    config = {"bos_token": bos, "add_bos_token": True, "chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}
    ]}  # fmt: skip
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": EOS}, "pad_token": EOS, "unk_token": "<nope>"})
    )
    files = read_hf_tokenizer(tmp_path)
    assert files is not None
    assert (files.eos_token, files.bos_token, files.adds_bos) == (EOS, BOS, True)
    # <nope> is not in the vocabulary: dropped
    assert files.config == {
        "chat_template": "chat",
        "eos_token": EOS,
        "bos_token": BOS,
        "pad_token": EOS,
        "add_bos_token": True,
    }
    assert files.special_tokens == [EOS, BOS]


def test_import_chat_template_jinja_file(tmp_path: Path) -> None:
    """transformers 5 saves the chat template beside the config, in chat_template.jinja."""
    (tmp_path / "tokenizer.json").write_text(tiny_bpe().to_str())
    (tmp_path / "chat_template.jinja").write_text(CHATML.template)
    files = read_hf_tokenizer(tmp_path)
    assert files is not None and files.chat_template == CHATML.template
    assert files.eos_token is None and files.special_tokens == [EOS, BOS]  # added, in id order
    write_run_tokenizer(files, tmp_path / "run")
    assert Tokenizer.load(tmp_path / "run").chat_template == CHATML.template


def test_import_legacy_gpt2_files(tmp_path: Path) -> None:
    """vocab.json + merges.txt alone: converted as transformers' GPT-2 tokenizer, which
    knows only <|endoftext|> as a special token (so <s> is plain text)."""
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    tiny_bpe().model.save(str(legacy))
    assert sorted(p.name for p in legacy.iterdir()) == ["merges.txt", "vocab.json"]
    files = read_hf_tokenizer(legacy)
    assert files is not None
    assert files.source == "vocab.json + merges.txt"
    assert files.eos_token == EOS and files.special_tokens == [EOS]
    run = tmp_path / "run"
    write_run_tokenizer(files, run)
    llm = Tokenizer.load(run, eos_token=files.special_tokens[0])
    hf = GPT2TokenizerFast.from_pretrained(legacy)
    assert_same_ids(llm, hf)
    assert len(llm.encode(BOS)) > 1


def test_import_legacy_with_config_uses_its_class(tmp_path: Path) -> None:
    tiny_bpe().model.save(str(tmp_path))
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": EOS, "bos_token": BOS}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    files = read_hf_tokenizer(tmp_path)
    assert files is not None and (files.eos_token, files.bos_token) == (EOS, BOS)
    llm = Tokenizer.from_str(files.tokenizer_json)
    assert_same_ids(llm, AutoTokenizer.from_pretrained(tmp_path, local_files_only=True))
    assert llm.encode(BOS) == [1]  # declared bos: an added token now


def test_sentencepiece_model_names_file_and_package(tmp_path: Path) -> None:
    from transformers.utils import is_sentencepiece_available

    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(LlmkitError) as err:
        read_hf_tokenizer(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path / "tokenizer.model") in msg
    if not is_sentencepiece_available():
        assert "sentencepiece package" in msg


# -- export -----------------------------------------------------------------------------------


def test_export_bpe_run_loads_in_auto_tokenizer(tmp_path: Path) -> None:
    llm = train_bpe(corpus(), 320, [EOS, "<|pad|>"], 2)
    run, out = tmp_path / "run", tmp_path / "hf"
    llm.save(run / "tokenizer.json")
    written = write_hf_tokenizer(run, out, eos_token=EOS, model_max_length=128)
    assert written == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(written)
    hf = AutoTokenizer.from_pretrained(out)
    assert_same_ids(llm, hf)
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == (EOS, EOS, None)
    assert hf.eos_token_id == llm.eos_id == 0 and hf.model_max_length == 128
    assert hf.chat_template is None
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["clean_up_tokenization_spaces"] is False
    for text in SAMPLES:
        assert hf.decode(hf_ids(hf, text)) == llm.decode(llm.encode(text)) == text


def test_export_chat_run_carries_template(tmp_path: Path) -> None:
    specials = [EOS, *CHATML.special_tokens]
    llm = train_bpe(corpus(), 320, specials, 2)
    llm.chat_template, llm.end_of_turn = CHATML.template, CHATML.end_of_turn
    run, out = tmp_path / "run", tmp_path / "hf"
    llm.save(run / "tokenizer.json")
    assert (run / CONFIG_FILE).is_file()
    write_hf_tokenizer(run, out, eos_token=EOS)
    hf = AutoTokenizer.from_pretrained(out)
    assert hf.chat_template == CHATML.template
    assert (hf.eos_token, hf.pad_token) == ("<|im_end|>", EOS)  # eos: the end of turn
    messages = [{"role": "user", "content": "héllo 🙂"}, {"role": "assistant", "content": "hi"}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == render(CHATML.template, messages, add_generation_prompt=True)
    run_tok = Tokenizer.load(run, eos_token=EOS)
    assert run_tok.apply_chat_template(messages) == hf_ids(hf, text)
    assert_same_ids(run_tok, hf, [*SAMPLES, text])


def test_export_char_tokenizer_same_ids(tmp_path: Path) -> None:
    """A char tokenizer (WordLevel over single characters) loads as PreTrainedTokenizerFast
    with llmkit's ids, unknown characters included; its <unk> is not declared, since
    transformers would then match the literal text "<unk>" as one token."""
    llm = train_char(["hello world <unk> héllo 🙂\t\n", "abc  def"], [EOS])
    run, out = tmp_path / "run", tmp_path / "hf"
    llm.save(run / "tokenizer.json")
    write_hf_tokenizer(run, out, eos_token=EOS)
    hf = AutoTokenizer.from_pretrained(out)
    samples = [*SAMPLES, "x<unk>y", "hello 🙂\tZ"]
    assert_same_ids(llm, hf, samples)
    assert hf.unk_token is None and hf.eos_token == EOS
    unk = llm.unk_id
    assert unk is not None and hf_ids(hf, "Z") == [unk]
    assert hf_ids(hf, "<unk>") == [llm.token_to_id(c) for c in "<unk>"]
    for text in samples:
        assert hf.decode(hf_ids(hf, text)) == llm.decode(llm.encode(text))


def test_round_trip_keeps_tokenizer_json(hf_dir: Path, tmp_path: Path) -> None:
    files = read_hf_tokenizer(hf_dir)
    assert files is not None
    run, out = tmp_path / "run", tmp_path / "hf"
    write_run_tokenizer(files, run)
    write_hf_tokenizer(run, out, eos_token=files.eos_token)
    original = json.loads((hf_dir / "tokenizer.json").read_text())
    assert json.loads((out / "tokenizer.json").read_text()) == original
    back = json.loads((out / CONFIG_FILE).read_text())
    assert (back["eos_token"], back["bos_token"]) == (EOS, BOS)
    assert_same_ids(AutoTokenizer.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(out))


# -- errors -----------------------------------------------------------------------------------


def one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(LlmkitError) as err:
        call(*args, **kwargs)
    msg = str(err.value)
    assert msg and "\n" not in msg
    return msg


@pytest.mark.parametrize("content", ["{not json", '{"model": {"type": "Nope"}}', "[]"])
def test_malformed_tokenizer_json(tmp_path: Path, content: str) -> None:
    (tmp_path / "tokenizer.json").write_text(content)
    assert str(tmp_path / "tokenizer.json") in one_line_error(read_hf_tokenizer, tmp_path)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"eos_token": 3}'])
def test_malformed_tokenizer_config(tmp_path: Path, content: str) -> None:
    (tmp_path / "tokenizer.json").write_text(tiny_bpe().to_str())
    (tmp_path / CONFIG_FILE).write_text(content)
    assert str(tmp_path / CONFIG_FILE) in one_line_error(read_hf_tokenizer, tmp_path)


def test_no_tokenizer_is_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert read_hf_tokenizer(tmp_path) is None


def test_config_without_vocabulary_or_merges(tmp_path: Path) -> None:
    (tmp_path / CONFIG_FILE).write_text("{}")
    assert str(tmp_path / CONFIG_FILE) in one_line_error(read_hf_tokenizer, tmp_path)
    (tmp_path / "vocab.json").write_text("{}")
    assert "merges.txt" in one_line_error(read_hf_tokenizer, tmp_path)


def test_export_run_without_tokenizer(tmp_path: Path) -> None:
    msg = one_line_error(write_hf_tokenizer, tmp_path, tmp_path / "out", eos_token=EOS)
    assert str(tmp_path / "tokenizer.json") in msg
    assert not (tmp_path / "out").exists()
