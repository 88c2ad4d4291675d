"""Task specs: the built-in formats render the benchmarks' JSONL layouts as lm-eval-harness
prompts them, few-shot prompts follow the seed, and bad specs or data are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmkit.errors import LlmkitError
from llmkit.evaluation import load_task

DOCS = {
    "hellaswag": {
        "activity_label": "Removing ice from car",
        "ctx_a": "Then, the man writes over the snow [title] covering the window.",
        "ctx_b": "a person",
        "endings": [" is seen  cleaning.", "[header] leaves.", "sings", "runs [step] away"],
        "label": "3",
    },
    "arc_easy": {
        "question": "Which is a gas?",
        "choices": {"text": ["ice", "steam", "rock"], "label": ["A", "B", "C"]},
        "answerKey": "B",
    },
    "piqa": {"goal": "Dry wet shoes", "sol1": "put them in sun", "sol2": "soak them", "label": 0},
    "openbookqa": {
        "question_stem": "The sun is",
        "choices": {"text": ["a star", "a moon"], "label": ["A", "B"]},
        "answerKey": "A",
    },
    "winogrande": {
        "sentence": "The cup did not fit in the box because the _ was too big.",
        "option1": "cup",
        "option2": "box",
        "answer": "1",
    },
    "lambada": {"text": "he opened the door and saw his old friend"},
}


def write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def only_item(tmp_path: Path, name: str):
    data = write_jsonl(tmp_path / f"{name}.jsonl", [DOCS[name]])
    task = load_task(f"{name}={data}")
    (item,) = task.items()
    return item


def test_hellaswag_is_cleaned_and_prompted_as_lm_eval_harness_does(tmp_path):
    item = only_item(tmp_path, "hellaswag")
    ctx = "Removing ice from car: Then, the man writes over the snow. covering the window. A person"
    assert [p[0] for p in item.pairs] == [ctx] * 4
    assert [p[1] for p in item.pairs] == [" is seen cleaning.", "  leaves.", " sings", " runs away"]
    assert item.gold == 3


def test_arc_gold_is_a_label(tmp_path):
    item = only_item(tmp_path, "arc_easy")
    assert item.pairs[1] == ("Question: Which is a gas?\nAnswer:", " steam")
    assert item.gold == 1 and item.choice_texts == ("ice", "steam", "rock")


def test_piqa_and_openbookqa(tmp_path):
    piqa = only_item(tmp_path, "piqa")
    assert piqa.pairs == (
        ("Question: Dry wet shoes\nAnswer:", " put them in sun"),
        ("Question: Dry wet shoes\nAnswer:", " soak them"),
    )
    assert piqa.gold == 0
    obqa = only_item(tmp_path, "openbookqa")
    assert obqa.pairs[0] == ("The sun is", " a star") and obqa.gold == 0


def test_winogrande_scores_the_shared_continuation_after_each_option(tmp_path):
    item = only_item(tmp_path, "winogrande")
    assert item.pairs == (
        ("The cup did not fit in the box because the cup", " was too big."),
        ("The cup did not fit in the box because the box", " was too big."),
    )
    assert item.gold == 0


def test_lambada_targets_the_last_word(tmp_path):
    item = only_item(tmp_path, "lambada")
    assert item.pairs == (("he opened the door and saw his old", " friend"),)


def few_shot_task(tmp_path: Path, **extra):
    docs = [{"q": f"q{i}", "options": ["yes", "no"], "answer": i % 2} for i in range(12)]
    write_jsonl(tmp_path / "yn.jsonl", docs)
    fields = {"data": "yn.jsonl", "context": "Q: {{ q }}\nA:", "choices": "options"}
    fields.update({"gold": "{{ answer }}", **extra})
    spec = tmp_path / "yn.toml"
    spec.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()))
    return load_task(spec)


def test_few_shot_prompts_follow_the_seed_and_never_show_the_item_itself(tmp_path):
    task = few_shot_task(tmp_path, description="Answer.\n\n")
    a = task.items(num_fewshot=3, seed=1)
    assert a == task.items(num_fewshot=3, seed=1)
    assert [i.pairs for i in a] != [i.pairs for i in task.items(num_fewshot=3, seed=2)]
    for item in a:
        ctx = item.pairs[0][0]
        assert ctx.startswith("Answer.\n\n") and ctx.endswith(f"Q: q{item.doc_index}\nA:")
        shots = ctx.removeprefix("Answer.\n\n").split("\n\n")
        assert len(shots) == 4  # three solved examples, then the question
        for shot in shots[:-1]:
            q = int(shot.split("\n")[0].removeprefix("Q: q"))
            assert q != item.doc_index
            assert shot == f"Q: q{q}\nA: {['yes', 'no'][q % 2]}"
    assert task.name == "yn" and task.items()[0].pairs[0][0] == "Answer.\n\nQ: q0\nA:"


def test_few_shot_examples_from_their_own_file(tmp_path):
    write_jsonl(tmp_path / "shots.jsonl", [{"q": "s", "options": ["yes", "no"], "answer": 1}])
    task = few_shot_task(tmp_path, fewshot_data="shots.jsonl", num_fewshot=1)
    assert all(i.pairs[0][0] == f"Q: s\nA: no\n\nQ: q{i.doc_index}\nA:" for i in task.items())
    with pytest.raises(LlmkitError, match="2 few-shot examples asked for"):
        task.items(num_fewshot=2)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"context": "{{ missing }}"}, r"line 1\): context template: 'missing' is undefined"),
        ({"gold": "{{ answer + 5 }}"}, r"document 1 \(yn.jsonl line 1\): gold index 5 is outside"),
        ({"gold": "maybe"}, "gold 'maybe' is neither an index, a label nor a choice"),
        ({"choices": "q"}, "choices field 'q' is not a non-empty list"),
    ],
)
def test_a_document_the_spec_cannot_render_is_named(tmp_path, extra, message):
    task = few_shot_task(tmp_path, **extra)
    with pytest.raises(LlmkitError, match=message):
        task.items()


def test_bad_task_references_are_one_line_errors(tmp_path):
    with pytest.raises(LlmkitError, match="needs its data file: --task hellaswag=PATH"):
        load_task("hellaswag")
    with pytest.raises(LlmkitError, match="not a task file"):
        load_task("nonsense")
    with pytest.raises(LlmkitError, match="file not found"):
        load_task(f"piqa={tmp_path / 'none.jsonl'}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"goal": "x"}\nnot json\n')
    with pytest.raises(LlmkitError, match=r"bad\.jsonl:2: invalid JSON"):
        load_task(f"piqa={bad}")
    spec = tmp_path / "t.toml"
    spec.write_text('data = "x.jsonl"\nchoices = "o"\nsurprise = 1\n')
    with pytest.raises(LlmkitError, match="surprise: Extra inputs are not permitted"):
        load_task(spec)
    spec.write_text('data = "x.jsonl"\nformat = "partial"\nchoices = "o"\n')
    with pytest.raises(LlmkitError, match="a partial task needs continuation"):
        load_task(spec)
