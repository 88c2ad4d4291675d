"""Chat data: templates, loss masks token by token, packed and padded batches (training and
evaluation), exact sampler resume with masks, the cached mask files, and the chat template
carried by the run's tokenizer."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from llmkit.data import (
    IGNORE,
    BlockSampler,
    PaddedSampler,
    RandomWindowSampler,
    TokenFile,
    eval_batches,
    make_sampler,
    padded_examples,
    prepare_data,
)
from llmkit.data.chat import ChatTemplateError, render, segments
from llmkit.data.tokenizer import CONFIG_FILE, Tokenizer, read_config, train_char
from llmkit.errors import LlmkitError
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

EOS, START, END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
INSTRUCTION = {"prompt": "hi", "response": "yo"}
CHAT = {
    "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
    ]
}
#: What each record renders to, as (text, trained) pieces, for each built-in template.
EXPECTED = {
    "plain": [
        [("User: hi\nAssistant:", False), (" yo" + EOS, True)],
        [
            ("System: sys\nUser: u1\nAssistant:", False),
            (" a1" + EOS, True),
            ("User: u2\nAssistant:", False),
            (" a2" + EOS, True),
        ],
    ],
    "chatml": [
        [(f"{START}user\nhi{END}\n{START}assistant\n", False), (f"yo{END}\n", True)],
        [
            (f"{START}system\nsys{END}\n{START}user\nu1{END}\n{START}assistant\n", False),
            (f"a1{END}\n", True),
            (f"{START}user\nu2{END}\n{START}assistant\n", False),
            (f"a2{END}\n", True),
        ],
    ],
}


def quiet(_msg: str) -> None:
    pass


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def chat_rs(
    tmp_path: Path,
    records: list[Any] | None = None,
    *,
    sampling: str = "packed",
    block_size: int = 16,
    **source: Any,
) -> Any:
    """A resolved spec over a chat file of ``records`` (train) and one validation record;
    a char tokenizer, so every character is one token."""
    train = write_jsonl(tmp_path / "train.jsonl", records or [INSTRUCTION, CHAT])
    val = write_jsonl(tmp_path / "val.jsonl", [CHAT, INSTRUCTION])
    spec = tiny_spec(vocab_size=128, max_seq_len=64)
    spec["tokenizer"] = {"kind": "char"}
    spec["data"] = {
        "source": {"name": "chat", "paths": [str(train)], "val_paths": [str(val)], **source},
        "sampling": sampling,
        "block_size": block_size,
    }
    return load_spec_dict(spec)


def char_tokens(text: str) -> list[str]:
    """``text`` as a char tokenizer cuts it: one token per character, special tokens whole."""
    out, i = [], 0
    while i < len(text):
        special = next((t for t in (EOS, START, END) if text.startswith(t, i)), None)
        out.append(special or text[i])
        i += len(special or text[i])
    return out


def expected_doc(pieces: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    return [(t, trained) for text, trained in pieces for t in char_tokens(text)]


def doc_tokens(tf: TokenFile, tok: Tokenizer, doc: int) -> list[tuple[str, bool]]:
    b, ids, mask = tf.doc_bounds, tf.array, tf.mask
    span = range(int(b[doc]), int(b[doc + 1]))
    return [(tok.decode([int(ids[i])]), bool(mask[i])) for i in span]


# -- templates and masks ----------------------------------------------------------------------


@pytest.mark.parametrize("template", ["plain", "chatml"])
def test_masks_token_by_token_for_both_forms(template: str, tmp_path: Path) -> None:
    data = prepare_data(chat_rs(tmp_path, template=template), tmp_path / "run", log=quiet)
    tf, tok = data.train, data.tokenizer
    assert tf.has_mask and tf.n_documents == 2 and len(tf.doc_bounds) == 3
    for doc, pieces in enumerate(EXPECTED[template]):
        assert doc_tokens(tf, tok, doc) == expected_doc(pieces)
    assert tf.n_bytes_text == sum(
        len(text.encode()) for pieces in EXPECTED[template] for text, _ in pieces
    )
    if template == "chatml":  # the template's tokens joined the trained tokenizer, once each
        assert list(tok.special_tokens) == [EOS, START, END]
    else:
        assert list(tok.special_tokens) == [EOS]


def test_mask_prompt_false_trains_every_token(tmp_path: Path) -> None:
    data = prepare_data(chat_rs(tmp_path, mask_prompt=False), tmp_path / "run", log=quiet)
    assert data.train.mask is not None and bool(np.all(data.train.mask == 1))


def test_segments_of_a_custom_template_and_its_errors() -> None:
    jinja = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    msgs = CHAT["messages"]
    assert segments(jinja, msgs) == [
        ("<system>sys<user>u1<assistant>", False),
        ("a1", True),
        ("<user>u2<assistant>", False),
        ("a2", True),
    ]
    assert render(jinja, msgs[:2], add_generation_prompt=True) == "<system>sys<user>u1<assistant>"
    reordering = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"messages\[:3\] does not extend"):
        segments(reordering, msgs)
    strict = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="chat template: roles must alternate"):
        render(strict, msgs)
    with pytest.raises(ChatTemplateError, match="Jinja syntax error at line 2"):
        render("ok\n{% if %}", msgs)


def test_custom_template_errors_name_the_record(tmp_path: Path) -> None:
    jinja = "{% if messages|length > 3 %}{{ raise_exception('too long') }}{% endif %}x"
    rs = chat_rs(tmp_path, template=jinja)
    with pytest.raises(LlmkitError, match=r"train\.jsonl:2: chat template: too long"):
        prepare_data(rs, tmp_path / "run", log=quiet)


def test_custom_template_with_its_own_tokens(tmp_path: Path) -> None:
    jinja = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}<eot>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    rs = chat_rs(tmp_path, template=jinja, special_tokens=["<eot>"], end_of_turn="<eot>")
    data = prepare_data(rs, tmp_path / "run", log=quiet)
    tok = data.tokenizer
    assert tok.end_of_turn == "<eot>" and tok.stop_ids == sorted(
        {tok.eos_id, tok.token_to_id("<eot>")}
    )
    trained = [t for t, m in doc_tokens(data.train, tok, 0) if m]
    assert trained == ["y", "o", "<eot>"]
    rs = chat_rs(tmp_path, template=jinja, end_of_turn="<nope>")
    with pytest.raises(LlmkitError, match="end_of_turn '<nope>' is not a token"):
        prepare_data(rs, tmp_path / "run2", log=quiet)


# -- the tokenizer carries the template -------------------------------------------------------


def test_template_saved_in_the_run_and_loaded_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    prepare_data(chat_rs(tmp_path, template="chatml"), run, log=quiet)
    config = json.loads((run / CONFIG_FILE).read_text())
    assert config["eos_token"] == END and config["pad_token"] == EOS
    assert "<|im_start|>" in config["chat_template"]
    tok = Tokenizer.load(run)  # the directory, as runs load it
    assert tok.chat_template == config["chat_template"] and tok.end_of_turn == END
    assert tok.stop_ids == sorted([tok.token_to_id(END), tok.eos_id])
    msgs = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == f"{START}user\nhi{END}\n{START}assistant\n"
    assert tok.apply_chat_template(msgs) == tok.encode(text)
    assert tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False) == (
        f"{START}user\nhi{END}\n"
    )
    with pytest.raises(LlmkitError, match=r"messages\[0\]\.role: unknown role 'bot'"):
        tok.apply_chat_template([{"role": "bot", "content": "x"}])
    tok.save(tmp_path / "copy" / "tokenizer.json")  # a copy keeps its template
    assert Tokenizer.load(tmp_path / "copy").chat_template == tok.chat_template


def test_a_tokenizer_without_template(tmp_path: Path) -> None:
    tok = train_char(["abc"])
    tok.save(tmp_path / "tokenizer.json")
    assert not (tmp_path / CONFIG_FILE).exists()
    loaded = Tokenizer.load(tmp_path)
    assert loaded.chat_template is None and loaded.stop_ids == [loaded.eos_id]
    with pytest.raises(LlmkitError, match="no chat template"):
        loaded.apply_chat_template([{"role": "user", "content": "a"}])


def test_hugging_face_config_forms(tmp_path: Path) -> None:
    path = tmp_path / CONFIG_FILE
    path.write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "T"},
                    {"name": "default", "template": "D"},
                ],
                "eos_token": {"content": "</s>", "special": True},
                "bos_token": "<s>",
            }
        )
    )
    assert read_config(path) == ("D", "</s>", "<s>")
    train_char(["<s>hi"]).save(tmp_path / "tokenizer.json")
    tok = Tokenizer.load(tmp_path)
    assert (tok.chat_template, tok.end_of_turn, tok.bos_token) == ("D", "</s>", "<s>")
    path.write_text(json.dumps({"chat_template": "{{ bos_token }}{{ messages[0]['content'] }}"}))
    tok = Tokenizer.load(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    tok.bos_token = "<s>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<s>hi"
    path.write_text("{oops")
    with pytest.raises(LlmkitError, match=r"tokenizer_config\.json: invalid JSON"):
        read_config(path)


def test_plain_fits_a_base_tokenizer_chatml_needs_its_tokens(tmp_path: Path) -> None:
    base = train_char(["User: Assistant: System: hi yo sys u1 a1 u2 a2\n"])
    logs: list[str] = []
    data = prepare_data(chat_rs(tmp_path, template="plain"), tmp_path / "a", base, log=logs.append)
    assert data.tokenizer.vocab_size == base.vocab_size
    assert not any("warning" in m for m in logs)
    assert (tmp_path / "a" / CONFIG_FILE).is_file()
    with pytest.raises(LlmkitError, match=r"template 'chatml' needs the token '<\|im_start\|>'"):
        prepare_data(chat_rs(tmp_path, template="chatml"), tmp_path / "b", base, log=quiet)
    logs.clear()
    narrow = train_char(["hi yo sys u1 a1 u2 a2"])  # no letters of the role markers
    prepare_data(chat_rs(tmp_path, template="plain"), tmp_path / "c", narrow, log=logs.append)
    assert any("warning: the tokenizer has no token for some text of template" in m for m in logs)


# -- token files ------------------------------------------------------------------------------


def test_mask_files_are_cached_and_keyed(tmp_path: Path) -> None:
    logs: list[str] = []
    rs = chat_rs(tmp_path)
    first = prepare_data(rs, tmp_path / "run", log=logs.append)
    stem = first.train.path.with_suffix("")
    assert all(stem.with_suffix(s).is_file() for s in (".bin", ".mask", ".docs", ".json"))
    logs.clear()
    again = prepare_data(rs, tmp_path / "run", log=logs.append)
    assert any(m.startswith("data: train:") and "(cached" in m for m in logs)
    assert again.key == first.key
    assert np.array_equal(again.train.mask, first.train.mask)
    stem.with_suffix(".mask").unlink()  # a lost mask file is written again, not trusted
    logs.clear()
    prepare_data(rs, tmp_path / "run", log=logs.append)
    assert not any(m.startswith("data: train:") and "(cached" in m for m in logs)
    other = prepare_data(chat_rs(tmp_path, mask_prompt=False), tmp_path / "run", log=quiet)
    assert other.key != first.key


# -- packed blocks ----------------------------------------------------------------------------


def masked_corpus(n: int = 2001, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Ids 0..n-1 (so a target is its input + 1) and a mask with long untrained stretches,
    so some blocks hold no trained target."""
    rng = np.random.default_rng(seed)
    mask = (rng.random(n) < 0.3).astype(np.uint8)
    mask[100:400] = 0
    mask[1500:1700] = 0
    return np.arange(n), mask


def check_masked(x: torch.Tensor, y: torch.Tensor, mask: np.ndarray) -> None:
    """Every target is its input + 1 where the mask is 1 and -100 where it is 0; no row
    lacks a trained target."""
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        for xi, yi in zip(row_x, row_y):
            assert yi == (xi + 1 if mask[xi + 1] else IGNORE)
        assert any(yi != IGNORE for yi in row_y)


def test_packed_blocks_mask_targets_and_skip_untrained_blocks() -> None:
    tokens, mask = masked_corpus()
    s = BlockSampler(tokens, 10, seed=3, mask=mask)
    valid = {i for i in range(s.n_blocks) if mask[i * 10 + 1 : i * 10 + 11].any()}
    assert len(valid) < s.n_blocks  # some blocks are wholly untrained
    x, y = s.next_batch(len(valid))  # exactly epoch 0
    check_masked(x, y, mask)
    assert sorted((x[:, 0] // 10).tolist()) == sorted(valid)
    assert s.state_dict() == {"epoch": 0, "index": len(valid), "world_size": 1}
    x, y = s.next_batch(50)  # epoch 1: a shifted grid, still masked
    check_masked(x, y, mask)
    assert len(set((x[:, 0] % 10).tolist())) == 1


def draw_all(sampler: Any, steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [sampler.next_batch(batch) for _ in range(steps)]


def same(a: list[Any], b: list[Any]) -> bool:
    return all(torch.equal(u[0], v[0]) and torch.equal(u[1], v[1]) for u, v in zip(a, b))


@pytest.mark.parametrize("kind", ["packed", "padded", "random"])
def test_masked_samplers_resume_exactly(kind: str) -> None:
    tokens, mask = masked_corpus()
    bounds = np.array([0, 37, 120, 400, 410, 800, 1000, 1234, 1500, 1750, 1900, 2001])
    kw = {"mask": mask, "bounds": bounds}
    original = make_sampler(kind, tokens, 12, 7, **kw)
    draw_all(original, 9, 5)  # crosses into later epochs
    state = json.loads(json.dumps(original.state_dict()))
    restored = make_sampler(kind, tokens, 12, 7, **kw)
    restored.load_state_dict(state)
    assert same(draw_all(original, 12, 5), draw_all(restored, 12, 5))
    fresh = make_sampler(kind, tokens, 12, 7, **kw)
    assert not same(draw_all(fresh, 12, 5), draw_all(restored, 12, 5))


def test_masked_packed_ranks_share_the_trained_blocks() -> None:
    tokens, mask = masked_corpus()
    ranks = [BlockSampler(tokens, 10, seed=5, rank=r, world_size=2, mask=mask) for r in range(2)]
    single = BlockSampler(tokens, 10, seed=5, mask=mask)
    for epoch in (0, 1):
        a, b = set(ranks[0].order(epoch)), set(ranks[1].order(epoch))
        assert not a & b and len(a) == len(b)
        assert a | b <= set(single.order(epoch))
    for _ in range(5):  # lockstep ranks read what one process reads with the global batch
        want = sorted(single.next_batch(8)[0][:, 0].tolist())
        got = ranks[0].next_batch(4)[0][:, 0].tolist() + ranks[1].next_batch(4)[0][:, 0].tolist()
        assert sorted(got) == want


def test_random_windows_with_a_mask() -> None:
    tokens, mask = masked_corpus()
    s = RandomWindowSampler(tokens, 16, seed=2, mask=mask)
    for _ in range(5):
        check_masked(*s.next_batch(8), mask)
    with pytest.raises(LlmkitError, match="no token is a trained target"):
        RandomWindowSampler(tokens, 16, mask=np.zeros_like(mask))


# -- padded rows ------------------------------------------------------------------------------


def test_padded_rows_truncate_and_skip() -> None:
    tokens = np.arange(60)
    mask = np.ones(60, np.uint8)
    mask[20:40] = 0  # document 2 (20..40) has no trained token
    mask[40:52] = 0  # document 3 (40..60): its first trained target is beyond the row
    bounds = np.array([0, 5, 20, 40, 60, 60])  # 5 tokens, 15 (cut), 20, 20 (cut), empty
    used, cut, left = padded_examples(bounds, mask, 8)
    assert used.tolist() == [0, 1] and cut == 3 and left == 3
    s = PaddedSampler(tokens, 8, seed=0, mask=mask, bounds=bounds)
    assert (s.n_blocks, s.truncated, s.skipped) == (2, 3, 3)
    x, y = s.next_batch(2)
    rows = {int(r[0]): (r.tolist(), t.tolist()) for r, t in zip(x, y)}
    pad = 0  # no EOS known for a bare array
    assert rows[0] == ([0, 1, 2, 3, *[pad] * 4], [1, 2, 3, 4, *[IGNORE] * 4])
    assert rows[5] == (list(range(5, 13)), list(range(6, 14)))  # cut to block_size + 1
    mask[8] = 0
    x, y = PaddedSampler(tokens, 8, seed=0, mask=mask, bounds=bounds).next_batch(2)
    assert IGNORE in y[x[:, 0] == 5][0].tolist()
    with pytest.raises(LlmkitError, match="no document has a trained token"):
        PaddedSampler(tokens, 8, mask=np.zeros(60, np.uint8), bounds=bounds)
    with pytest.raises(LlmkitError, match="needs document boundaries"):
        PaddedSampler(tokens, 8)


def test_padded_rows_from_a_prepared_chat_split(tmp_path: Path) -> None:
    logs: list[str] = []
    rs = chat_rs(tmp_path, sampling="padded", template="chatml", block_size=48)
    data = prepare_data(rs, tmp_path / "run", log=logs.append)
    assert data.train.layout == data.validation.layout == "padded"
    note = "data: train: 2 documents, one per row of 48 tokens; 1 longer than the row are truncated"
    assert note in logs
    s = make_sampler("padded", data.train, 48, 1)
    assert isinstance(s, PaddedSampler) and s.truncated == 1 and s.skipped == 0
    tf, tok = data.train, data.tokenizer
    x, y = s.next_batch(2)
    rows = sorted(zip(x.tolist(), y.tolist()), key=lambda r: r[0].count(0))
    for doc, (row_x, row_y) in enumerate(rows):
        start, end = int(tf.doc_bounds[doc]), int(tf.doc_bounds[doc + 1])
        ids = [int(t) for t in tf.array[start : min(end, start + 49)]]
        m = [int(k) for k in tf.mask[start : min(end, start + 49)]]
        pad = 48 - (len(ids) - 1)
        assert row_x == ids[:-1] + [tok.eos_id] * pad  # padded with the EOS
        assert row_y == [t if k else IGNORE for t, k in zip(ids[1:], m[1:])] + [IGNORE] * pad
    assert {tok.decode([int(t)]) for t in x[:, 0]} == {START}  # rows start at conversations
    with pytest.raises(LlmkitError, match="train split: no document has a trained token"):
        prepare_data(chat_rs(tmp_path, sampling="padded", template="chatml"), tmp_path / "r2")


def test_padded_sampling_of_plain_text_uses_the_eos(tmp_path: Path) -> None:
    for i in range(4):
        (tmp_path / f"{i}.txt").write_text(f"document number {i} " * (i + 1))
    spec = tiny_spec(vocab_size=128)
    spec["tokenizer"] = {"kind": "char"}
    paths = [str(tmp_path / "*.txt")]
    spec["data"] = {
        "source": {"name": "text", "paths": paths, "split": "file", "val_fraction": 0.3}
    }
    spec["data"] |= {"sampling": "padded", "block_size": 32}
    data = prepare_data(load_spec_dict(spec), tmp_path / "run", log=quiet)
    assert data.train.mask is None
    s = make_sampler("padded", data.train, 32, 0)
    x, y = s.next_batch(s.n_blocks)
    assert (y[:, 0] != IGNORE).all()
    eos = data.tokenizer.eos_id
    starts = [0, *(np.flatnonzero(data.train.array == eos) + 1)][:-1]
    assert sorted(x[:, 0].tolist()) == sorted(int(data.train.array[i]) for i in starts)


# -- evaluation -------------------------------------------------------------------------------


def test_eval_batches_with_masks_are_fixed_and_masked() -> None:
    tokens, mask = masked_corpus()
    a = list(eval_batches(tokens, 10, 4, 3, mask=mask))
    b = list(eval_batches(tokens, 10, 4, 3, mask=mask))
    assert len(a) == 3 and same(a, b)
    for x, y in a:
        check_masked(x, y, mask)
    bounds = np.array([0, 37, 120, 400, 410, 800, 2001])
    padded = list(eval_batches(tokens, 12, 2, 5, layout="padded", mask=mask, bounds=bounds))
    used = padded_examples(bounds, mask, 12)[0]
    assert sum(len(x) for x, _ in padded) == len(used)
    for _, y in padded:
        assert (y != IGNORE).any(dim=1).all()
    with pytest.raises(LlmkitError, match="no block of 10 tokens holds a trained target"):
        list(eval_batches(tokens, 10, 4, 3, mask=np.zeros_like(mask)))


def test_masked_evaluation_counts_only_trained_targets(tmp_path: Path) -> None:
    from llmkit.evaluation.perplexity import evaluate_batches
    from llmkit.model import build_model

    data = prepare_data(chat_rs(tmp_path, template="chatml"), tmp_path / "run", log=quiet)
    spec = tiny_spec(vocab_size=data.tokenizer.vocab_size, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(load_spec_dict(spec)).eval()
    batches = list(eval_batches(data.validation, 16, 4, 2))
    res = evaluate_batches(model, batches, torch.device("cpu"))
    assert res.tokens == sum(int((y != IGNORE).sum()) for _, y in batches)
    with torch.no_grad():
        logits = torch.cat([model(x).logits for x, _ in batches]).flatten(0, 1)
    targets = torch.cat([y for _, y in batches]).flatten()
    keep = targets != IGNORE
    want = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    assert abs(res.loss - float(want)) < 1e-5


@pytest.mark.parametrize("template", ["plain", "chatml"])
def test_hugging_face_reads_the_runs_template_alike(template: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    run = tmp_path / "run"
    prepare_data(chat_rs(tmp_path, template=template), run, log=quiet)
    ours = Tokenizer.load(run)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(run))
    msgs = [*CHAT["messages"], {"role": "user", "content": "u3"}]
    want = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(msgs, tokenize=False) == want
    assert ours.apply_chat_template(msgs) == theirs(want, add_special_tokens=False)["input_ids"]
    assert theirs.eos_token == (END if template == "chatml" else EOS)


def test_padded_examples_matches_a_row_by_row_count() -> None:
    rng = np.random.default_rng(4)
    for trial in range(20):
        lengths = rng.integers(0, 30, size=rng.integers(1, 40))
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        mask = (rng.random(int(bounds[-1])) < 0.1 * (trial % 4)).astype(np.uint8)
        block = int(rng.integers(1, 20))
        keep = [
            e - s >= 2 and bool(mask[s + 1 : min(e, s + block + 1)].any())
            for s, e in itertools.pairwise(bounds)
        ]
        used, cut, left = padded_examples(bounds, mask, block)
        assert used.tolist() == [i for i, k in enumerate(keep) if k]
        assert cut == int((lengths > block + 1).sum()) and left == keep.count(False)


def test_json_lines_records_may_hold_unicode_line_separators(tmp_path: Path) -> None:
    from llmkit.components.dataset.chat import read_records

    records = [
        {"prompt": "a\u2028b\u0085c", "response": "d\u2029e"},
        {"prompt": "f", "response": "g"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n")
    read = read_records(path)
    assert [where for where, _ in read] == [f"{path}:1", f"{path}:2"]
    assert read[0][1][0]["content"] == "a\u2028b\u0085c" and read[0][1][1]["content"] == "d\u2029e"


def test_a_masked_packed_epoch_never_lacks_trained_blocks() -> None:
    # Trained targets at tokens 1-3 only: a shifted grid can leave none in any block; such
    # an epoch keeps epoch 0's grid instead of stopping the run.
    from llmkit.data.samplers import BlockSampler

    mask = np.zeros(1000, np.uint8)
    mask[1:4] = 1
    sampler = BlockSampler(np.arange(1000), 8, seed=0, mask=mask)
    for _ in range(12):  # one trained block an epoch: twelve epochs
        _, y = sampler.next_batch(1)
        assert bool((y != -100).any())
    assert sampler.epoch >= 10


@pytest.mark.parametrize("layout", ["jsonl", "array"])
def test_a_deeply_nested_chat_file_is_one_line_naming_it(tmp_path, layout):
    from llmkit.components.dataset.chat import read_records

    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / f"chat.{'jsonl' if layout == 'jsonl' else 'json'}"
    ok = '{"prompt": "a", "response": "b"}'
    path.write_text(f"{ok}\n{deep}\n" if layout == "jsonl" else deep, encoding="utf-8")
    where = f"{path}:2" if layout == "jsonl" else str(path)
    with pytest.raises(LlmkitError, match=rf"^{where}: not valid JSON \(nested too deeply\)$"):
        read_records(path)
