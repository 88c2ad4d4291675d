"""Chat data in training and evaluation: a small padded validation split is enough, `llmkit
eval` scores only the trained (assistant) tokens as training does, and the whole fine-tuning
path — a text base, init_from, LoRA, chat data, generate --chat — works end to end."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from llmkit.cli import main
from llmkit.training import train
from tests.helpers import write_train_spec

PAIRS = [("hi", "ok"), ("bye", "ciao"), ("yes", "si")] * 8


def quiet() -> dict:
    return {"log": lambda _m: None, "progress": False}


def chat_spec(tmp: Path, *, template: str = "chatml", sampling: str = "padded", **train_) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in PAIRS))
    spec = {
        "name": "chat-unit",
        "model": {
            "vocab_size": 64,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 2,
            "max_seq_len": 48,
            "position": {"name": "rope"},
        },
        "tokenizer": {"kind": "char"},
        "data": {
            "source": {"name": "chat", "paths": [str(data)], "template": template},
            "sampling": sampling,
            "block_size": 40,
        },
        "optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.0},
        "schedule": {"name": "constant"},
        "train": {
            "batch_size": 8,
            "max_steps": 30,
            "eval_interval": 30,
            "eval_batches": 4,
            "log_interval": 10,
            "precision": "fp32",
            "sample_tokens": 0,
            **train_,
        },
    }
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_small_padded_validation_split_is_enough(tmp_path):
    """Two conversations of ~25 tokens each: fewer tokens than a block + 1 in a packed
    sense, but two whole padded rows."""
    spec = chat_spec(tmp_path, max_steps=2, eval_interval=2)
    data = yaml.safe_load(spec.read_text())
    data["data"]["source"]["val_fraction"] = 2 / len(PAIRS)
    spec.write_text(yaml.safe_dump(data))
    result = train(spec, run_dir=tmp_path / "run", **quiet())
    assert result.val_loss is not None


@pytest.mark.parametrize("sampling", ["padded", "packed"])
def test_eval_scores_the_trained_tokens_as_training_does(tmp_path, capsys, sampling):
    result = train(chat_spec(tmp_path, sampling=sampling), run_dir=tmp_path / "run", **quiet())
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--json"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["loss"] == pytest.approx(result.val_loss, abs=1e-4)
    assert report["bytes"] is None  # per-byte figures mean nothing for a part of the text
    assert "trained tokens" in out.err


def test_a_chat_run_counts_the_tokens_it_trains_on(tmp_path, capsys):
    """Padded rows and masked prompts are fed to the model but not trained on: the
    metrics' ``trained_tokens`` (and the done line) count the targets that are not -100,
    exactly, beside the tokens seen."""
    from llmkit.data import make_sampler, prepare_data
    from llmkit.runs import open_run
    from tests.training.kill_resume import read_metrics

    spec = chat_spec(tmp_path, max_steps=6, eval_interval=6, log_interval=3)
    run = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(run), "--no-sample", "--no-progress"]) == 0
    out = capsys.readouterr().out
    steps = [m for m in read_metrics(run) if "loss" in m]
    # The same batches, drawn again: their targets that are not -100.
    rs = open_run(run).resolve()
    data = prepare_data(rs, run, log=lambda _m: None)
    sampler = make_sampler(rs.spec.data.sampling, data.train, 40, rs.spec.train.seed)
    trained = [int((sampler.next_batch(8)[1] != -100).sum()) for _ in range(6)]
    assert [m["trained_tokens"] for m in steps] == [sum(trained[:3]), sum(trained)]
    assert [m["tokens"] for m in steps] == [3 * 8 * 40, 6 * 8 * 40]  # fed, padding included
    assert sum(trained) < 6 * 8 * 40 / 3  # mostly padding and prompts
    assert all(0 < m["trained_tokens_per_s"] < m["tokens_per_s"] for m in steps)
    assert f"done: 6 steps, 1,920 tokens ({sum(trained):,} trained) in " in out
    assert re.search(r"^step 6/6: loss [\d.]+ lr \S+ \d+ tok/s \(\d+ trained\)", out, re.M)


def test_chat_fine_tuning_of_a_text_base_with_lora(tmp_path, capsys):
    from llmkit.training import sample_text

    corpus = "".join(f"User: {p}\nAssistant: {r}\n" for p, r in PAIRS) * 20
    base = write_train_spec(
        tmp_path / "b", corpus, max_steps=20, eval_interval=20, sample_prompt="def "
    )
    base_data = yaml.safe_load(base.read_text())
    base_data["model"]["max_seq_len"] = 48
    base.write_text(yaml.safe_dump(base_data))
    train(base, run_dir=tmp_path / "base", **quiet())
    spec = chat_spec(
        tmp_path / "c", template="plain", init_from=str(tmp_path / "base"), max_steps=100
    )
    data = yaml.safe_load(spec.read_text())
    data["model"] = yaml.safe_load(base.read_text())["model"]
    data["model"]["adapter"] = {"name": "lora", "rank": 8, "targets": ["*"]}
    # What `extends` of the base's spec gives: the text base's prompt, no user message.
    data["train"].update(sample_prompt="def ", sample_tokens=12)
    spec.write_text(yaml.safe_dump(data))
    result = train(spec, run_dir=tmp_path / "tuned", **quiet())
    # The sample answers the first user turn of the validation data instead.
    user, reply = sample_text(result).split("\n", 1)
    assert user in {f"[user, from the validation data] {p}" for p, _ in PAIRS}, user
    assert reply.startswith("[assistant] ")
    capsys.readouterr()
    args = ["generate", str(tmp_path / "tuned"), "--chat", "bye", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.strip() == "ciao"
    assert main(["merge-lora", str(tmp_path / "tuned"), str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()  # the template travels
    capsys.readouterr()
    args[1] = str(tmp_path / "merged")
    assert main([*args, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.strip() == "ciao"


def test_the_end_of_training_sample_of_a_chat_model_is_a_reply(tmp_path):
    from llmkit.training import sample_text

    spec = chat_spec(tmp_path, max_steps=60, sample_tokens=12, sample_prompt="yes")
    data = yaml.safe_load(spec.read_text())
    data["train"]["sample_tokens"], data["train"]["sample_prompt"] = 12, "yes"
    spec.write_text(yaml.safe_dump(data))
    result = train(spec, run_dir=tmp_path / "run", **quiet())
    text = sample_text(result)
    assert text.startswith("[user] yes\n[assistant] s")  # sampled (temperature 0.8)
    reply = text.split("[assistant] ")[1]
    assert 0 < len(reply) < 12 and "<|im" not in reply  # stopped at the end of its turn
    # Without a prompt, a chat run answers its first validation conversation's user turn
    # (not a continuation of the document separator).
    unprompted = dataclasses.replace(
        result, spec=result.spec.with_settings({"train.sample_prompt": ""})
    )
    user, reply = sample_text(unprompted).split("\n", 1)
    assert user in {f"[user, from the validation data] {p}" for p, _ in PAIRS}, user
    assert reply.startswith("[assistant] ") and "<|im" not in reply


def test_a_fine_tune_may_add_the_templates_tokens_to_its_vocabulary(tmp_path, capsys):
    import hashlib

    from llmkit.errors import LlmkitError

    corpus = "".join(f"{p} {r}\n" for p, r in PAIRS) * 20
    base = write_train_spec(tmp_path / "b", corpus, max_steps=10, eval_interval=10)
    base_data = yaml.safe_load(base.read_text())
    base_data["model"]["max_seq_len"] = 48
    base.write_text(yaml.safe_dump(base_data))
    train(base, run_dir=tmp_path / "base", **quiet())
    before = hashlib.sha256((tmp_path / "base" / "tokenizer.json").read_bytes()).hexdigest()
    spec = chat_spec(tmp_path / "c", init_from=str(tmp_path / "base"), max_steps=60)
    data = yaml.safe_load(spec.read_text())
    data["model"] = base_data["model"]
    spec.write_text(yaml.safe_dump(data))
    with pytest.raises(LlmkitError, match="init_resize_vocab"):
        train(spec, run_dir=tmp_path / "refused", **quiet())
    logs: list[str] = []
    result = train(
        spec,
        run_dir=tmp_path / "tuned",
        overrides=["train.init_resize_vocab=true"],
        log=logs.append,
        progress=False,
    )
    base_vocab = yaml.safe_load((tmp_path / "base" / "spec.yaml").read_text())["model"][
        "vocab_size"
    ]
    assert result.spec.model.vocab_size == base_vocab + 2  # <|im_start|>, <|im_end|>
    assert any(f"{base_vocab}->{base_vocab + 2} rows" in m for m in logs)
    digest = hashlib.sha256((tmp_path / "base" / "tokenizer.json").read_bytes()).hexdigest()
    assert digest == before  # the source's tokenizer is untouched
    capsys.readouterr()
    args = ["generate", str(tmp_path / "tuned"), "--chat", "bye", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.strip() == "ciao"


@pytest.mark.parametrize("sampling", ["padded", "packed"])
def test_a_chat_run_resumes_exactly(tmp_path, sampling):
    from tests.training.kill_resume import losses, train_killed_and_resumed, val_losses

    spec = chat_spec(
        tmp_path / "s",
        sampling=sampling,
        max_steps=24,
        eval_interval=12,
        checkpoint_interval=4,
        log_interval=1,
    )
    full, run, killed_at = train_killed_and_resumed(spec, tmp_path, kill_at=8)
    assert killed_at < 24
    assert losses(run) == losses(full) and len(losses(full)) == 24
    assert val_losses(run) == val_losses(full)

    def trained(run: Path) -> list[tuple[int, int, int]]:  # the counts carry over exactly
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [(m["step"], m["tokens"], m["trained_tokens"]) for m in rows if "loss" in m]

    assert trained(run) == trained(full)
    assert trained(full)[-1][2] < trained(full)[-1][1]  # padding and prompts not counted
