"""Task metrics: which choice each normalisation picks, standard errors, and the results a
run keeps."""

from __future__ import annotations

import json
import math

import pytest

from llmkit.evaluation import ItemScore, TaskResult, save_result, task_metrics


def score(gold: int, logprobs, tokens, nbytes, chars, greedy=None) -> ItemScore:
    return ItemScore(0, gold, list(logprobs), list(tokens), list(nbytes), list(chars),
                     list(greedy or [False] * len(logprobs)))  # fmt: skip


def test_each_normalisation_picks_its_own_choice():
    # sums: choice 0 best; per char: 1; per token: 2; per byte: 1
    item = score(1, [-4.0, -6.0, -9.0], tokens=[1, 2, 9], nbytes=[2, 12, 5], chars=[1, 12, 5])
    assert item.pick() == 0
    assert item.pick("char") == 1 and item.pick("token") == 2 and item.pick("byte") == 1
    m = task_metrics("multiple_choice", [item])
    assert (m["acc"], m["acc_norm"], m["acc_norm_token"], m["acc_norm_byte"]) == (0, 1, 0, 1)
    assert m["chance"] == pytest.approx(1 / 3) and math.isnan(m["acc_stderr"])


def test_stderr_is_the_sample_deviation_over_root_n():
    right = score(0, [-1.0, -2.0], [1, 1], [1, 1], [1, 1])
    wrong = score(1, [-1.0, -2.0], [1, 1], [1, 1], [1, 1])
    m = task_metrics("multiple_choice", [right, right, right, wrong])
    assert m["acc"] == 0.75
    assert m["acc_stderr"] == pytest.approx(math.sqrt(0.25 / 4))  # var 0.25 (n - 1 = 3)
    partial = task_metrics("partial", [right, wrong])
    assert set(partial) == {"acc", "acc_stderr", "chance"}


def test_completion_accuracy_is_greedy_and_perplexity_is_per_item():
    items = [score(0, [-1.0], [2], [3], [3], [True]), score(0, [-3.0], [2], [3], [3], [False])]
    m = task_metrics("completion", items)
    assert m["acc"] == 0.5 and m["ppl"] == pytest.approx(math.exp(2.0))


def test_results_land_in_the_run_and_its_history(tmp_path):
    from types import SimpleNamespace

    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    task = SimpleNamespace(source=data)
    items = [score(0, [-1.0, -2.0], [1, 1], [1, 1], [1, 1])]
    result = TaskResult("demo", "multiple_choice", 2, 7, items, task_metrics("partial", items))
    path = save_result(tmp_path, result, task, weights=tmp_path / "model.safetensors")
    assert path == tmp_path / "eval" / "demo-2shot.json"
    saved = json.loads(path.read_text())
    assert saved["metrics"]["acc"] == 1.0 and saved["metrics"]["acc_stderr"] is None  # NaN
    assert saved["num_fewshot"] == 2 and saved["seed"] == 7 and "samples" not in saved
    assert len(saved["data_sha256"]) == 64
    save_result(tmp_path, result, task, weights=tmp_path / "x", samples=True)
    assert json.loads(path.read_text())["samples"][0]["logprobs"] == [-1.0, -2.0]
    history = (tmp_path / "eval" / "results.jsonl").read_text().splitlines()
    assert len(history) == 2 and all("samples" not in json.loads(h) for h in history)
