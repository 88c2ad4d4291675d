"""Hostile task files, chat templates and eval data: templates render with bounded work
(range, loop steps, output size, time), task records are type-checked and size-bounded, deep
JSON is one line naming the file and line, and a long eval text is counted in pieces."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import llmkit.data.chat as chat
import llmkit.evaluation.tasks as tasks
from llmkit.data.chat import ChatEncoder, ChatTemplateError, render
from llmkit.data.tokenizer import Tokenizer, train_char
from llmkit.errors import LlmkitError
from llmkit.evaluation import load_task
from llmkit.evaluation.perplexity import sliding_batches, text_size

HANG = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
#: Templates that would hang or exhaust memory unbounded, and what stops each.
HOSTILE = [
    (HANG, r"more than 1,000,000 loop iterations and calls"),
    ("{% for i in range(10**6) %}{% endfor %}", r"range\(\) of 1,000,000 items \(at most 10,000\)"),
    ("{{ 'x' * 10**10 }}", r"would build 10,000,000,000 characters"),
    ("{{ 2 ** (10**9) }}", r"a power of more than 65,536 bits"),
    (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        r"built 33,554,432 characters",
    ),
    ("{{ 'x'|center(10**10) }}", r"center\(\) width 10,000,000,000"),
    ("{{ 'x'.ljust(10**10) }}", r"str\.ljust\(\) width 10,000,000,000"),
    ("{{ '{:>9999999999}'.format(1) }}", r"a format width of 9999999999"),
    ("{{ '%9999999999d' % 1 }}", r"a format width of 9999999999"),
    ("{% set s = 'ab' * 4000000 %}{{ s|replace('', s) }}", r"would build"),
    (
        "{% set s = 'x' * 1000000 %}{% set big %}{% for i in range(100) %}{{ s }}{% endfor %}"
        "{% endset %}{{ big|length }}",
        r"an output of more than 16,777,216 characters",
    ),
]


@pytest.mark.parametrize(("template", "message"), HOSTILE)
def test_a_hostile_chat_template_stops_in_one_line(template: str, message: str) -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"^chat template: template limit: " + message):
        render(template, [{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < 5


def test_rendering_has_a_time_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)
    slow = (
        "{% set s = 'x' * 2000000 %}{% for i in range(10000) %}{% for j in range(90) %}"
        "{{ (s ~ s)|length }}{% endfor %}{% endfor %}"
    )
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"rendering took longer than 0\.3 s"):
        render(slow, [])
    assert time.monotonic() - start < 3


def test_ordinary_templates_render_as_before() -> None:
    template = (
        "{% for m in messages %}{{ '<|' ~ m['role'] ~ '|>' }}{{ m['content'] | trim }}\n"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
        "{{ '%-3s|' % 'a' }}{{ '{:>3}'.format(7) }}{{ 'x'|center(5) }}{{ range(3)|list }}"
    )
    out = render(template, [{"role": "user", "content": " hi "}], add_generation_prompt=True)
    assert out == "<|user|>hi\n<|assistant|>a  |  7  x  [0, 1, 2]"


def test_an_imported_chat_template_is_bounded_and_named(tmp_path: Path) -> None:
    train_char(["hi"], ["<|endoftext|>"]).save(tmp_path / "tokenizer.json")
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": HANG}))
    tok = Tokenizer.load(tmp_path)
    start = time.monotonic()
    with pytest.raises(LlmkitError) as err:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    message = str(err.value)
    assert message.startswith(f"{config}: chat_template: template limit: more than 1,000,000")
    assert "\n" not in message and time.monotonic() - start < 5


def test_a_chat_dataset_template_is_bounded_and_names_the_record() -> None:
    tok = train_char(["<>userassistant hi"], ["<|endoftext|>"])
    encoder = ChatEncoder(tok.to_str(), HANG, tok.template_tokens(), True)
    conv = json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}])
    with pytest.raises(LlmkitError, match=r"^data\.jsonl:5: chat template: template limit: more"):
        encoder([conv], ["data.jsonl:5"])


# -- task files ---------------------------------------------------------------------------------


def task_file(tmp_path: Path, docs: list, lines: list[str] | None = None, **spec) -> Path:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs) + "".join(lines or []))
    fields = {"data": "data.jsonl", "context": "{{ q }}", "choices": "options", **spec}
    path = tmp_path / "t.toml"
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()))
    return path


def test_a_task_template_is_bounded_and_names_the_document(tmp_path: Path) -> None:
    doc = {"q": "x", "options": ["a", "b"], "label": 0}
    task = load_task(task_file(tmp_path, [doc, doc], context=HANG))
    start = time.monotonic()
    with pytest.raises(LlmkitError, match=r"document 1 \(data\.jsonl line 1\): context template: "):
        task.items()
    assert time.monotonic() - start < 5


def test_choices_given_as_a_string_are_refused_not_scored_per_character(tmp_path: Path) -> None:
    hella = {"activity_label": "A", "ctx_a": "b", "ctx_b": "c", "endings": "wxyz", "label": 0}
    data = tmp_path / "h.jsonl"
    data.write_text(json.dumps({**hella, "endings": ["w", "x"]}) + "\n" + json.dumps(hella) + "\n")
    task = load_task(f"hellaswag={data}")
    with pytest.raises(LlmkitError, match=r"document 2 \(h\.jsonl line 2\): field 'endings' must"):
        task.items()
    docs = [{"q": "x", "options": ["a", 7], "label": 0}]
    with pytest.raises(LlmkitError, match=r"line 1\): choices 'options' field must be a list of "):
        load_task(task_file(tmp_path, docs)).items()
    docs = [{"q": "x", "options": "ab", "label": 0}]
    with pytest.raises(LlmkitError, match=r"is not a non-empty list \(got a string\)"):
        load_task(task_file(tmp_path, docs)).items()
    labelled = [{"q": "x", "options": ["a", "b"], "ids": [1, 2], "label": 2}]
    (item,) = load_task(task_file(tmp_path, labelled, labels="ids")).items()
    assert item.gold == 1  # numeric labels are compared as text


def test_deeply_nested_json_in_a_task_file_is_one_line(tmp_path: Path) -> None:
    deep = '{"q": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    path = task_file(tmp_path, [{"q": "x", "options": ["a"], "label": 0}], [deep])
    with pytest.raises(LlmkitError, match=r"data\.jsonl:2: invalid JSON: nested too deeply$"):
        load_task(path)


def test_task_lines_and_items_are_bounded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tasks, "MAX_DOCUMENT_CHARS", 1000)
    doc = {"q": "x", "options": ["a", "b"], "label": 0}
    path = task_file(tmp_path, [doc, {**doc, "q": "y" * 2000}])
    with pytest.raises(LlmkitError, match=r"data\.jsonl:2: a line longer than 1,000 characters"):
        load_task(path)
    monkeypatch.setattr(tasks, "MAX_DOCUMENT_CHARS", 10_000)
    monkeypatch.setattr(tasks, "MAX_ITEM_CHARS", 1000)
    with pytest.raises(LlmkitError, match=r"document 2 \(data\.jsonl line 2\): its prompts hold"):
        load_task(path).items()
    monkeypatch.setattr(tasks, "MAX_ITEM_CHARS", 10_000)
    monkeypatch.setattr(tasks, "MAX_TASK_CHARS", 10_000)
    many = task_file(tmp_path, [{**doc, "q": "y" * 500}] * 30, num_fewshot=8)
    with pytest.raises(LlmkitError, match=r"prompts hold more than 10,000 characters by .*--limit"):
        load_task(many).items()


# -- eval text ----------------------------------------------------------------------------------


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1 << 20])
def test_text_size_counts_words_and_bytes_across_pieces(piece: int) -> None:
    for text in ["a bc  déf\n\n g", "  lead", "trail  ", "東京 🚀x", "x", " "]:
        assert text_size(text, piece) == (len(text.encode("utf-8")), len(text.split()))


def test_sliding_batches_of_int32_tokens_are_int64() -> None:
    ids = torch.arange(100) % 37
    wide = list(sliding_batches(ids, 16, 8, 4))
    narrow = list(sliding_batches(ids.to(torch.int32), 16, 8, 4))
    assert all(x.dtype == y.dtype == torch.long for x, y in narrow)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(wide, narrow))


def test_documents_are_kept_as_text_and_capped_in_number(tmp_path: Path, monkeypatch) -> None:
    docs = [{"q": f"q{i}", "options": ["a", "b"], "label": i % 2} for i in range(5)]
    task = load_task(task_file(tmp_path, docs, ["\n"]))
    assert isinstance(task.docs, tasks.Documents) and list(task.docs) == docs
    assert task.docs[-1] == docs[-1] and task.docs[1:3] == docs[1:3]
    monkeypatch.setattr(tasks, "MAX_DOCUMENTS", 3)
    with pytest.raises(
        LlmkitError, match=r"task t: 5 documents, more than the limit of 3 .*--limit"
    ):
        task.items()
    assert len(task.items(limit=3)) == 3


PARSE = """
import resource, sys
sys.path.insert(0, {root!r})
from llmkit.evaluation import load_task
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
task = load_task({ref!r})
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024, len(task.docs))
"""


def test_a_task_file_of_tiny_json_values_is_held_as_text(tmp_path: Path) -> None:
    """10 MB of ``[],`` parse into ≈ 200 MB of lists; the documents are kept as their text
    (parsed when rendered), so loading the task holds a few times the file's size."""
    import subprocess
    import sys

    line = '{"q": [' + "[]," * 400_000 + '[]], "options": ["a"], "label": 0}\n'
    (tmp_path / "lists.jsonl").write_text(line * 8)
    root = str(Path(__file__).parents[2])
    code = PARSE.format(root=root, ref=f"piqa={tmp_path / 'lists.jsonl'}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    grew_mib, n_docs = map(int, out.stdout.split())
    assert n_docs == 8 and grew_mib < 100, f"loading 10 MB of JSON grew RSS by {grew_mib} MiB"
