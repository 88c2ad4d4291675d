"""Chat data in training and evaluation: a small padded validation split is enough, `llmkit
eval` scores only the trained (assistant) tokens as training does, and the whole fine-tuning
path — a text base, init_from, LoRA, chat data, generate --chat — works end to end."""

from __future__ import annotations

import json
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


def test_chat_fine_tuning_of_a_text_base_with_lora(tmp_path, capsys):
    corpus = "".join(f"User: {p}\nAssistant: {r}\n" for p, r in PAIRS) * 20
    base = write_train_spec(tmp_path / "b", corpus, max_steps=20, eval_interval=20)
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
    spec.write_text(yaml.safe_dump(data))
    train(spec, run_dir=tmp_path / "tuned", **quiet())
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
