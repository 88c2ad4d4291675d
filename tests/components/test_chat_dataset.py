"""The chat dataset source: record forms, splits, templates and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmkit.components.dataset.chat import CHATML, PLAIN, to_messages
from llmkit.errors import LlmkitError
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

SYSTEM = {"role": "system", "content": "be brief"}


def source(**options: Any) -> Any:
    spec = tiny_spec()
    spec["data"] = {"source": {"name": "chat", **options}}
    rs = load_spec_dict(spec)
    return rs.dataset.build(rs.dataset.options)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def conversations(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(n):
        if i % 2:
            out.append({"prompt": f"q{i}", "response": f"a{i}", "id": i})
        else:
            turns = [SYSTEM, {"role": "user", "content": f"u{i}"}]
            out.append({"messages": [*turns, {"role": "assistant", "content": f"r{i}"}]})
    return out


def test_both_record_forms_become_messages(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "d.jsonl", conversations(10))
    parts = source(paths=[str(f)], val_fraction=0.2).splits(3)
    assert len(parts["train"]) == 8 and len(parts["validation"]) == 2
    assert set(parts["train"].column_names) == {"text", "messages", "where"}
    everything = [json.loads(m) for p in parts.values() for m in p["messages"]]
    assert [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}] in (
        everything
    )
    assert [SYSTEM, {"role": "user", "content": "u0"}, {"role": "assistant", "content": "r0"}] in (
        everything
    )
    wheres = sorted(w for p in parts.values() for w in p["where"])
    assert wheres == sorted(f"{f}:{n}" for n in range(1, 11))
    again = source(paths=[str(f)], val_fraction=0.2).splits(3)
    assert list(again["validation"]["messages"]) == list(parts["validation"]["messages"])


def test_instruction_system_and_json_arrays(tmp_path: Path) -> None:
    rec = {"system": "s", "prompt": "p", "response": "r"}
    assert to_messages(rec, "x") == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "p"},
        {"role": "assistant", "content": "r"},
    ]
    array = tmp_path / "d.json"
    array.write_text(json.dumps(conversations(4)))
    val = write_jsonl(tmp_path / "val.jsonl", conversations(2))
    src = source(paths=[str(tmp_path / "*.json*")], val_paths=[str(val)])
    parts = src.splits(0)
    assert len(parts["train"]) == 4 and len(parts["validation"]) == 2
    assert parts["train"]["where"][0] == f"{array}: record 0"
    assert "4 train and 2 validation conversations" in src.describe()


def test_chat_format_builtins_and_custom() -> None:
    assert source(paths=["x"]).chat_format() == PLAIN
    fmt = source(paths=["x"], template="chatml", mask_prompt=False).chat_format()
    assert fmt.special_tokens == ("<|im_start|>", "<|im_end|>") and not fmt.mask_prompt
    assert fmt.end_of_turn == "<|im_end|>" and fmt.template == CHATML.template
    jinja = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    custom = source(paths=["x"], template=jinja, special_tokens=["<t>"], end_of_turn="<t>")
    assert custom.chat_format().name == "custom"
    assert custom.chat_format().special_tokens == ("<t>",)
    assert custom.chat_format().end_of_turn == "<t>"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            {"template": "chatmll"},
            r"template.*unknown template 'chatmll' \(built-in: plain, chatml",
        ),
        ({"template": "{% for m in messages %}"}, r"template.*Jinja syntax error at line 1"),
        ({"special_tokens": [""]}, "special token cannot be empty"),
        ({"mask_prompt": "maybe"}, "mask_prompt"),
    ],
)
def test_bad_options(options: dict[str, Any], match: str) -> None:
    with pytest.raises(LlmkitError, match=match) as info:
        source(paths=["x"], **options)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"text": "hi"}', r"d\.jsonl:2: a record needs 'messages' \(chat\) or 'prompt' and"),
        ("[1, 2]", r"d\.jsonl:2: a record must be a JSON object, got a list"),
        ("{not json", r"d\.jsonl:2: not valid JSON"),
        ('{"prompt": "p"}', r"d\.jsonl:2: response: missing"),
        ('{"prompt": "p", "response": "  "}', r"d\.jsonl:2: response: empty assistant turn"),
        ('{"prompt": 3, "response": "r"}', r"d\.jsonl:2: prompt: expected a string, got a number"),
        (
            '{"messages": [{"role": "user", "content": "u"}, {"role": "tool", "content": "t"}]}',
            r"d\.jsonl:2: messages\[1\]\.role: unknown role 'tool' \(system, user, assistant\)",
        ),
        (
            '{"messages": [{"role": "user", "content": "u"}, '
            '{"role": "assistant", "content": ""}]}',
            r"d\.jsonl:2: messages\[1\]\.content: empty assistant turn",
        ),
        (
            '{"messages": [{"role": "user", "content": null}]}',
            r"d\.jsonl:2: messages\[0\]\.content: expected a string, got null",
        ),
        ('{"messages": [{"role": "user", "content": "u"}]}', r"d\.jsonl:2: .*no assistant turn"),
        ('{"messages": []}', r"d\.jsonl:2: messages: expected a non-empty list"),
        (
            '{"messages": [], "prompt": "p", "response": "r"}',
            r"d\.jsonl:2: a record has either 'messages' or 'prompt'/'response'",
        ),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path: Path, line: str, match: str) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "fine", "response": "ok"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(LlmkitError, match=match) as info:
        source(paths=[str(f)]).splits(0)
    assert "\n" not in str(info.value)


def test_empty_files_and_too_few_records(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(LlmkitError, match="no records in"):
        source(paths=[str(empty)]).splits(0)
    one = write_jsonl(tmp_path / "one.jsonl", conversations(1))
    with pytest.raises(LlmkitError, match="cannot be split"):
        source(paths=[str(one)]).splits(0)
    with pytest.raises(LlmkitError, match="file not found"):
        source(paths=[str(tmp_path / "missing.jsonl")]).splits(0)


def test_json_array_errors_name_the_line(tmp_path: Path) -> None:
    array = tmp_path / "d.json"
    array.write_text('[\n {"prompt": "p", "response": "r"},\n oops\n]\n')
    with pytest.raises(LlmkitError, match=r"d\.json:3: not valid JSON"):
        source(paths=[str(array)]).splits(0)
    array.write_text('[{"prompt": "p", "response": "r"}, {"prompt": "p"}]')
    with pytest.raises(LlmkitError, match=r"d\.json: record 1: response: missing"):
        source(paths=[str(array)]).splits(0)
    lists = tmp_path / "l.jsonl"
    lists.write_text('[1]\n{"prompt": "p", "response": "r"}\n')
    with pytest.raises(LlmkitError, match=r"l\.jsonl:1: a record must be a JSON object"):
        source(paths=[str(lists)]).splits(0)


def test_the_shipped_example_resolves_and_reads(monkeypatch) -> None:
    from llmkit.spec import load_spec
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)  # its paths are relative to the repository root
    rs = load_spec(ROOT / "examples" / "chat" / "chat-tiny.toml")
    assert rs.spec.data.sampling == "padded"
    src = rs.dataset.build(rs.dataset.options)
    parts = src.splits(rs.spec.train.seed)
    assert len(parts["train"]) + len(parts["validation"]) == 42
    assert src.chat_format().name == "chatml"
