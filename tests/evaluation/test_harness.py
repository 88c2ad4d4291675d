"""The lm-eval-harness adapter: llmkit runs evaluated by lm-eval (local task YAMLs over local
JSONL files, nothing downloaded) score exactly as llmkit's own scorer, generator and task
runner do; ``llmkit lm-eval`` passes its arguments to lm-eval's command line."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from llmkit.errors import LlmkitError
from tests.conftest import ROOT
from tests.helpers import tiny_spec

pytest.importorskip("lm_eval")

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
CORPUS = "the quick brown fox jumps over the lazy dog. Question: Answer? A cat sat on a mat!\n"
MAX_LEN = 48
EOS = "<|endoftext|>"

MC_DOCS = [
    {"q": "the fox", "choices": ["jumps", "sat on a mat", "over"], "label": 0},
    {"q": "a cat", "choices": ["sat", "the lazy dog"], "label": 1},
    {"q": "the lazy dog", "choices": ["jumps over", "the", "a cat", "quick"], "label": 2},
    {"q": "quick brown", "choices": ["fox", "dog"], "label": 0},
    {"q": "a mat", "choices": ["the cat sat on it", "brown", "over the dog"], "label": 1},
    {"q": "the dog sat", "choices": ["on a mat", "quick", "brown fox"], "label": 2},
]
ROLLING_DOCS = [
    {"text": "the quick brown fox"},
    {"text": "a cat sat on a mat. " * 8},  # longer than MAX_LEN: several windows
    {"text": "Question: the lazy dog?"},
]
GEN_DOCS = [
    {"q": "the quick brown", "a": "fox"},
    {"q": "a cat sat on", "a": "a mat"},
    {"q": "", "a": "the"},  # an empty prompt starts from the EOS
]
GEN_KWARGS = {"until": ["."], "max_gen_toks": 12, "do_sample": False}

MC_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{q}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
ROLLING_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""
GEN_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
generation_kwargs: {gen_kwargs}
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
#: The multiple-choice task as an llmkit task spec.
MC_TOML = """\
name = "harness_mc"
format = "multiple_choice"
data = "{data}"
context = "Question: {{{{ q }}}}\\nAnswer:"
choices = "choices"
gold = "{{{{ label }}}}"
"""


@pytest.fixture(autouse=True, scope="module")
def _offline_one_thread(one_thread):
    """Nothing downloaded (lm-eval and datasets offline), one thread (tests/conftest.py)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        for module, flag in (
            ("datasets.config", "HF_DATASETS_OFFLINE"),
            ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
        ):
            mp.setattr(importlib.import_module(module), flag, True, raising=False)
        yield


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with random weights and a char tokenizer whose EOS is EOS."""
    from llmkit.data.tokenizer import train_char
    from llmkit.model import build_model
    from llmkit.runs import TOKENIZER_FILE, save_spec
    from llmkit.runs.checkpoints import WEIGHTS, save_weights
    from llmkit.spec import load_spec_dict

    path = tmp_path_factory.mktemp("harness-run")
    tok = train_char([CORPUS], special_tokens=[EOS])
    spec = tiny_spec(
        vocab_size=tok.vocab_size, position={"name": "rope"}, max_seq_len=MAX_LEN, init_std=0.2
    )
    spec["tokenizer"] = {"kind": "char", "special_tokens": [EOS]}
    rs = load_spec_dict(spec)
    torch.manual_seed(0)
    save_spec(rs, path)
    save_weights(build_model(rs), path / WEIGHTS)
    tok.save(path / TOKENIZER_FILE)
    return path


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Task YAMLs (multiple choice, rolling, generation) over JSONL files beside them, and
    the multiple-choice task as an llmkit task spec (``harness_mc.toml``)."""
    path = tmp_path_factory.mktemp("harness-tasks")
    cache = path / "hf-cache"
    for name, docs, template in (
        ("harness_mc", MC_DOCS, MC_YAML),
        ("harness_rolling", ROLLING_DOCS, ROLLING_YAML),
        ("harness_gen", GEN_DOCS, GEN_YAML),
    ):
        data = path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
        text = template.format(name=name, data=data, cache=cache, gen_kwargs=json.dumps(GEN_KWARGS))
        (path / f"{name}.yaml").write_text(text, encoding="utf-8")
    (path / "harness_mc.toml").write_text(MC_TOML.format(data=path / "harness_mc.jsonl"))
    return path


@pytest.fixture(scope="module")
def harness_results(run_dir: Path, task_dir: Path) -> dict[str, Any]:
    """lm-eval's results for the three tasks, with the samples."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import llmkit.evaluation.harness  # noqa: F401  (registers the model)

    return lm_eval.simple_evaluate(
        model="llmkit",
        model_args=f"run={run_dir}",
        tasks=["harness_mc", "harness_rolling", "harness_gen"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
    )


@pytest.fixture(scope="module")
def loaded(run_dir: Path) -> Any:
    from llmkit.runs import load_run

    return load_run(run_dir)


@pytest.fixture(scope="module")
def scorer(loaded: Any) -> Any:
    from llmkit.evaluation import LoglikScorer

    return LoglikScorer(loaded.model, loaded.tokenizer)


def _samples(results: dict[str, Any], task: str) -> list[dict[str, Any]]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def _requests(kind: str, args: list[tuple[Any, ...]]) -> list[Any]:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i, ("t", i, 1)) for i, a in enumerate(args)]


def test_the_model_is_registered_once(run_dir):
    from lm_eval.api.registry import get_model

    harness = importlib.import_module("llmkit.evaluation.harness")
    importlib.import_module("llmkit.evaluation.harness")
    harness.register()
    harness.register()
    assert get_model("llmkit") is harness.LlmkitLM
    assert get_model("dummy").__name__ == "DummyLM"  # lm-eval's own models stay known


def test_multiple_choice_loglikelihoods_and_accuracy_are_llmkits(harness_results, scorer, task_dir):
    from llmkit.evaluation import evaluate_task, load_task

    samples = _samples(harness_results, "harness_mc")
    assert len(samples) == len(MC_DOCS)
    pairs = [tuple(a) for s in samples for a in s["arguments"]]
    assert pairs[0] == ("Question: the fox\nAnswer:", " jumps")
    ours = iter(scorer.loglikelihood(pairs))
    for sample in samples:
        for (logprob, greedy), resp in zip(sample["filtered_resps"], sample["resps"], strict=True):
            mine = next(ours)
            assert resp == [(logprob, greedy)]
            assert logprob == pytest.approx(mine.logprob, abs=1e-6)
            assert greedy == mine.greedy

    result = evaluate_task(scorer, load_task(task_dir / "harness_mc.toml"))
    for item, sample in zip(result.items, samples, strict=True):
        assert item.gold == sample["target"]
        lm_eval_logprobs = [lp for lp, _ in sample["filtered_resps"]]
        assert item.logprobs == pytest.approx(lm_eval_logprobs, abs=1e-6)
    metrics = harness_results["results"]["harness_mc"]
    for name in ("acc", "acc_norm"):
        assert metrics[f"{name},none"] == pytest.approx(result.metrics[name])
        assert metrics[f"{name}_stderr,none"] == pytest.approx(result.metrics[f"{name}_stderr"])


def test_rolling_loglikelihoods_are_llmkits(harness_results, scorer, run_dir):
    samples = _samples(harness_results, "harness_rolling")
    texts = [s["arguments"][0][0] for s in samples]
    assert texts == [d["text"] for d in ROLLING_DOCS]
    assert len(scorer.tokenizer.encode(texts[1])) > 2 * MAX_LEN
    for sample, text in zip(samples, texts, strict=True):
        assert sample["filtered_resps"][0] == pytest.approx(scorer.rolling(text).logprob, abs=1e-6)
    assert harness_results["results"]["harness_rolling"]["word_perplexity,none"] > 1

    from llmkit.evaluation.harness import LlmkitLM

    lm = LlmkitLM(run=str(run_dir), max_length="16")
    got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(texts[0],), ("",)]))
    assert got[0] == pytest.approx(lm.scorer.rolling(texts[0]).logprob, abs=1e-6)
    assert got[1] == 0.0  # lm-eval's score of an empty text


def test_generations_are_the_generators(harness_results, loaded):
    from llmkit.inference import Generator

    samples = _samples(harness_results, "harness_gen")
    contexts = [s["arguments"][0][0] for s in samples]
    assert contexts == [d["q"] for d in GEN_DOCS]
    gen = Generator(loaded.model, loaded.tokenizer)
    expected = gen.generate(
        contexts, max_new_tokens=GEN_KWARGS["max_gen_toks"], temperature=0, stop=GEN_KWARGS["until"]
    )
    assert [s["resps"][0][0] for s in samples] == [r.text for r in expected]
    assert not any("." in r.text for r in expected)


def test_generate_until_groups_settings_and_truncates_long_prompts(run_dir, loaded):
    """Requests with different settings keep their order; ``until`` may be a string; a
    temperature without ``do_sample`` is greedy; a prompt keeps its last tokens so that the
    generation fits in ``max_length``."""
    from llmkit.evaluation.harness import LlmkitLM
    from llmkit.inference import Generator

    lm = LlmkitLM(run=str(run_dir), batch_size="2")
    long_prompt = "the quick brown fox jumps over the lazy dog. " * 3
    args = [
        ("a cat", {"until": "t", "max_gen_toks": 6}),
        ("the dog", {"until": ["o", "x"], "max_gen_toks": 9, "temperature": 0.7}),
        ("the fox", {"until": "t", "max_gen_toks": 6}),
        (long_prompt, {"until": ["?"], "max_gen_toks": 10}),
        ("the mat", {"until": "t", "max_gen_toks": 6}),
    ]
    got = lm.generate_until(_requests("generate_until", args))
    gen = Generator(loaded.model, loaded.tokenizer)

    def greedy(prompts: list[Any], stop: list[str], n: int) -> list[str]:
        return [r.text for r in gen.generate(prompts, max_new_tokens=n, temperature=0, stop=stop)]

    first, third = greedy(["a cat", "the fox"], ["t"], 6)
    (fifth,) = greedy(["the mat"], ["t"], 6)
    (second,) = greedy(["the dog"], ["o", "x"], 9)
    ids = loaded.tokenizer.encode(long_prompt)
    assert len(ids) > MAX_LEN
    (fourth,) = greedy([ids[-(MAX_LEN - 10) :]], ["?"], 10)
    assert got == [first, second, third, fourth, fifth]


def test_model_arguments(run_dir):
    from llmkit.evaluation.harness import LlmkitLM

    lm = LlmkitLM.create_from_arg_string(
        f"run={run_dir},batch_size=4,max_length=32", {"batch_size": 1, "device": None}
    )
    assert lm.batch_size == 4 and lm.max_length == 32  # --model_args win over lm-eval's
    assert lm.scorer.batch_size == 4 and lm.scorer.max_length == 32
    lm = LlmkitLM.create_from_arg_obj({"run": str(run_dir)}, {"batch_size": "auto:4"})
    assert lm.batch_size == 16 and str(lm.device) == "cpu"
    if not torch.cuda.is_available():  # lm-eval's command line asks for cuda:0 by default
        lm = LlmkitLM.create_from_arg_obj({"run": str(run_dir)}, {"device": "cuda:0"})
        assert str(lm.device) == "cpu"
        with pytest.raises(LlmkitError, match="device"):
            LlmkitLM.create_from_arg_obj({"run": str(run_dir), "device": "cuda:0"})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("run={missing}", "run not found"),
        ("", "run is required"),
        ("run={run},weights=newest", "weights: 'newest' is not one of final, best, latest"),
        ("run={run},pretrained=gpt2", "unknown lm-eval model argument.*pretrained"),
        ("run={run},batch_size=0", "batch_size: must be ≥ 1"),
        ("run={run},max_length=4096", "max_length: 4096 is longer than the model's context"),
    ],
)
def test_user_errors_are_llmkit_errors(run_dir, tmp_path, args, message):
    from llmkit.evaluation.harness import LlmkitLM

    arg_string = args.format(missing=tmp_path / "nope", run=run_dir)
    with pytest.raises(LlmkitError, match=message):
        LlmkitLM.create_from_arg_string(arg_string)


def test_without_lm_eval_the_adapter_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval: ImportError
    monkeypatch.delitem(sys.modules, "llmkit.evaluation.harness", raising=False)
    with pytest.raises(LlmkitError) as info:
        importlib.import_module("llmkit.evaluation.harness")
    assert str(info.value) == (
        "the lm-eval-harness adapter needs the lm-eval extra: pip install 'llmkit[lm-eval]'"
    )


def test_the_command_passes_every_argument_to_lm_eval(monkeypatch, capsys):
    import llmkit.evaluation.harness as harness
    from llmkit.cli import main

    seen: list[list[str]] = []
    monkeypatch.setattr(harness, "main", lambda argv: seen.append(argv) or 3)
    argv = ["--model", "llmkit", "--model_args", "run=R", "--tasks", "t", "-h", "--", "x"]
    assert main(["lm-eval", *argv]) == 3
    assert seen == [argv]
    assert main(["lm-eval"]) == 0  # alone: llmkit's help for the command
    assert seen == [argv] and "--model llmkit" in capsys.readouterr().out


def test_llmkit_lm_eval_command(run_dir, task_dir, tmp_path, harness_results):
    """The command line end to end: lm-eval's own CLI finds the local task through
    --include_path, the model through the registration; its results are the same."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmkit.cli",
            "lm-eval",
            "--model",
            "llmkit",
            "--model_args",
            f"run={run_dir}",
            "--tasks",
            "harness_mc",
            "--include_path",
            str(task_dir),
            "--output_path",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **OFFLINE, "LLMKIT_PLUGINS": ""},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "harness_mc" in proc.stdout and "acc_norm" in proc.stdout
    (written,) = out.rglob("results_*.json")
    results = json.loads(written.read_text())["results"]["harness_mc"]
    expected = harness_results["results"]["harness_mc"]
    assert results["acc,none"] == pytest.approx(expected["acc,none"])
    assert results["acc_norm,none"] == pytest.approx(expected["acc_norm,none"])
