"""``llmkit eval`` only reads the run it evaluates: a run without data of its own (an
imported checkpoint, whose spec's data section is the built-in default corpus) needs
``--data``, and the validation split is prepared outside the run directory. A task item
that cannot be scored names the task and the item's line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from llmkit.cli import main
from llmkit.data.tokenizer import train_char
from llmkit.errors import LlmkitError
from llmkit.evaluation import LoglikScorer, evaluate_task, load_task
from llmkit.model import build_model
from llmkit.runs import save_spec
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.spec import resolve
from llmkit.training import train
from tests.evaluation.facts import facts_train_spec, write_facts
from tests.helpers import tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "the quick brown fox jumps over the lazy dog. Q: A:\n"


def files(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*")}


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err and len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def untrained_run(directory: Path, *, imported: bool) -> Path:
    """A run as ``llmkit import-hf`` writes one: spec (no data section), weights, tokenizer,
    and with ``imported`` its ``hf_source.json``."""
    tok = train_char([TEXT], special_tokens=["<|endoftext|>"])
    raw = tiny_spec(vocab_size=tok.vocab_size)
    raw["name"] = directory.name
    raw["tokenizer"] = {"kind": "char", "special_tokens": ["<|endoftext|>"]}
    rs = resolve(json.loads(json.dumps(raw)), source=str(directory / "spec.yaml"))
    directory.mkdir(parents=True)
    save_spec(rs, directory)
    torch.manual_seed(0)
    save_weights(build_model(rs), directory / WEIGHTS)
    tok.save(directory / "tokenizer.json")
    if imported:
        (directory / "hf_source.json").write_text('{"model_type": "llama"}\n')
    return directory


@pytest.mark.parametrize(
    ("imported", "reason"),
    [(True, "was imported (llmkit import-hf)"), (False, "never trained")],
)
def test_a_run_without_data_of_its_own_needs_data(tmp_path, capsys, imported, reason):
    run = untrained_run(tmp_path / "run", imported=imported)
    before = files(run)
    err = one_line_error(capsys, ["eval", str(run), "--no-save"])
    assert reason in err and "no validation split of its own" in err and "--data" in err
    err = one_line_error(capsys, ["eval", str(run), "--json", "--quantize", "int8"])
    assert "--data" in err
    assert files(run) == before  # no data/ tokenized from the default corpus
    text = tmp_path / "doc.txt"
    text.write_text(TEXT * 4)
    assert main(["eval", str(run), "--data", str(text), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == len(TEXT) * 4 - 1
    assert files(run) == before  # perplexity writes nothing


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    facts = write_facts(root, n=6, repeats=40)
    spec = facts_train_spec(root, facts["corpus"], max_steps=24)  # > warmup (20)
    train(str(spec), run_dir=root / "run", log=lambda _m: None, progress=False)
    return root / "run"


def test_the_validation_split_is_prepared_outside_the_run(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(tmp_path / "cache"))  # an empty shared store
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    assert any((run / "data").iterdir())
    before = files(run)
    assert main(["eval", str(run), "--json"]) == 0  # the run's own token files, read only
    own = json.loads(capsys.readouterr().out)
    assert files(run) == before
    shutil.rmtree(run / "data")  # token files gone: the corpus is tokenized again, elsewhere
    before = files(run)
    assert main(["eval", str(run), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert files(run) == before and not (run / "data").exists()
    assert again["tokens"] == own["tokens"] > 0
    assert again["loss"] == pytest.approx(own["loss"], abs=1e-6)


# -- a continuation that encodes to no tokens -------------------------------------------------


class _DropsTildes:
    """A tokenizer that encodes "~" to nothing (as a tokenizer's normalizer may drop text)."""

    def __init__(self, tok):
        self.tok, self.eos_id = tok, tok.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text.replace("~", ""))


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        (
            'format = "completion"\ncontext = "Q: {{ q }}"\ncontinuation = "{{ a }}"\n'
            'target_delimiter = ""\n',
            "",
        ),
        (
            'context = "Q: {{ q }}"\nchoices = ["{{ a }}", "{{ b }}"]\ngold = "0"\n'
            'target_delimiter = ""\n',
            ", choice 1",
        ),
    ],
)
def test_a_continuation_without_tokens_names_the_task_and_line(tmp_path, spec, where):
    data = tmp_path / "tildes.jsonl"
    docs = [{"q": "fox", "a": "dog", "b": "fox"}, {"q": "dog", "a": "~~", "b": "fox"}]
    data.write_text(json.dumps(docs[0]) + "\n\n" + json.dumps(docs[1]) + "\n")  # a blank line
    task_file = tmp_path / "tildes.toml"
    task_file.write_text(f'data = "tildes.jsonl"\n{spec}')
    tok = train_char([TEXT], special_tokens=["<|endoftext|>"])
    torch.manual_seed(0)
    model = build_model(resolve(tiny_spec(vocab_size=tok.vocab_size))).eval()
    scorer = LoglikScorer(model, _DropsTildes(tok))
    with pytest.raises(LlmkitError) as err:
        evaluate_task(scorer, load_task(task_file))
    message = str(err.value)
    assert message.startswith(f"task tildes, document 2 (tildes.jsonl line 3){where}: ")
    assert "encodes to no tokens" in message and "\n" not in message
