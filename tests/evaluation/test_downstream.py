"""Downstream tasks end to end: a model trained a little on synthetic facts scores well
above chance on their multiple-choice and completion forms, a random model does not, and
``llmkit eval --task`` reports and keeps the results."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmkit.cli import main
from llmkit.evaluation import LoglikScorer, evaluate_task, load_task
from llmkit.model import build_model
from llmkit.runs import load_run, open_run
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.training import train
from tests.evaluation.facts import facts_train_spec, write_facts


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs on one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    root = tmp_path_factory.mktemp("facts")
    files = write_facts(root)
    spec = facts_train_spec(root, files["corpus"], max_steps=200)
    train(str(spec), run_dir=root / "trained", log=lambda _m: None, progress=False)
    random_run = root / "random"
    shutil.copytree(root / "trained", random_run)
    torch.manual_seed(123)
    save_weights(build_model(open_run(random_run).resolve()), random_run / WEIGHTS)
    return {**files, "trained": root / "trained", "random": random_run}


def scores(run_dir, spec):
    run = load_run(run_dir)
    return evaluate_task(LoglikScorer(run.model, run.tokenizer), load_task(spec)).metrics


def test_a_trained_model_knows_the_facts_and_a_random_one_does_not(facts):
    trained, random_ = (
        scores(facts["trained"], facts["mc_spec"]),
        scores(facts["random"], facts["mc_spec"]),
    )
    assert trained["chance"] == 0.25
    assert trained["acc"] >= 0.9 and trained["acc_norm"] >= 0.9
    assert random_["acc"] <= 0.5  # 24 items: ≥ 0.9 by luck is impossible in practice
    gen_trained = scores(facts["trained"], facts["gen_spec"])
    gen_random = scores(facts["random"], facts["gen_spec"])
    assert gen_trained["acc"] >= 0.8 and gen_random["acc"] == 0.0
    assert gen_trained["ppl"] < gen_random["ppl"] / 10


def test_eval_task_prints_saves_and_reports_json(facts, capsys):
    run = str(facts["trained"])
    argv = ["eval", run, "--task", str(facts["mc_spec"]), "--task", str(facts["gen_spec"])]
    assert main([*argv, "--num-fewshot", "2", "--seed", "3", "--limit", "10", "--json"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert "capitals" in out.err and "acc_norm_byte" in out.err
    assert set(report) == {"tasks"}  # no --data: the tasks alone
    mc = report["tasks"]["capitals"]
    assert mc["items"] == 10 and mc["num_fewshot"] == 2 and mc["seed"] == 3
    saved = json.loads((facts["trained"] / "eval" / "capitals-2shot.json").read_text())
    assert saved["metrics"] == mc["metrics"] and saved["weights"].endswith(WEIGHTS)
    history = (facts["trained"] / "eval" / "results.jsonl").read_text().splitlines()
    assert [json.loads(h)["task"] for h in history[-2:]] == ["capitals", "capitals_gen"]
    # the same prompts again: the same numbers; samples on request
    assert main([*argv[:4], "--num-fewshot", "2", "--seed", "3", "--limit", "10",
                 "--log-samples", "--json"]) == 0  # fmt: skip
    again = json.loads(capsys.readouterr().out)["tasks"]["capitals"]
    assert again["metrics"] == mc["metrics"]
    saved = json.loads((facts["trained"] / "eval" / "capitals-2shot.json").read_text())
    assert len(saved["samples"]) == 10 and len(saved["samples"][0]["logprobs"]) == 4
    # --quantize compares perplexities: with tasks alone, on the validation split too
    assert main([*argv[:4], "--limit", "4", "--quantize", "int8", "--json", "--no-save"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert {"tasks", "int8", "loss"} <= set(both) and both["int8"]["weight_bytes"] > 0


def test_sliding_windows_score_the_same_tokens_with_more_context(facts, tmp_path, capsys):
    text = tmp_path / "held_out.txt"
    text.write_text(facts["corpus"].read_text()[:3000])
    run = str(facts["trained"])
    assert main(["eval", run, "--data", str(text), "--json"]) == 0
    disjoint = json.loads(capsys.readouterr().out)
    assert main(["eval", run, "--data", str(text), "--stride", "16", "--json"]) == 0
    sliding = json.loads(capsys.readouterr().out)
    assert disjoint["tokens"] == sliding["tokens"] == 2999
    assert (disjoint["context"], disjoint["stride"], sliding["stride"]) == (64, 64, 16)
    assert sliding["loss"] < disjoint["loss"]  # every token sees ≥ 48 tokens of context
    assert disjoint["words"] == len(text.read_text().split())
    assert disjoint["word_perplexity"] > disjoint["ppl"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--task", "hellaswag"], "task hellaswag needs its data file"),
        (["--data", "x", "--stride", "65"], "--stride 65 is longer than the context (64)"),
        (["--data", "x", "--context", "65"], "--context 65 is longer than the model's"),
    ],
)
def test_bad_eval_arguments_are_one_line_errors(facts, capsys, extra, message):
    assert main(["eval", str(facts["trained"]), *extra]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
