"""Fine-tuning with adapters: base frozen, only adapters optimised and saved, exact resume,
merge-lora, and generation and evaluation equal with adapters attached or merged."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from llmkit.cli import main
from llmkit.errors import LlmkitError
from llmkit.inference import Generator, Sampling
from llmkit.runs import load_run
from llmkit.training import train
from tests.helpers import write_train_spec
from tests.training.kill_resume import losses, train_killed_and_resumed, val_losses

CORPUS = "Tea for two and two for tea, me for you and you for me.\n" * 150
ADAPTER = {"name": "lora", "rank": 4, "alpha": 8.0, "targets": ["attn.qkv", "ffn.*"]}


def quiet() -> dict:
    return {"log": lambda _m: None, "progress": False}


def lora_spec(tmp_path: Path, base: Path, adapter: dict | None = None, **train_) -> Path:
    spec = write_train_spec(tmp_path, CORPUS, init_from=str(base), **train_)
    data = yaml.safe_load(spec.read_text())
    data["model"]["adapter"] = adapter or ADAPTER
    data["optimizer"]["lr"] = 1e-2
    spec.write_text(yaml.safe_dump(data))
    return spec


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("base")
    spec = write_train_spec(tmp, CORPUS, max_steps=20, eval_interval=20)
    train(spec, run_dir=tmp / "run", **quiet())
    return tmp / "run"


@pytest.fixture(scope="module")
def tuned(base, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("tuned")
    train(lora_spec(tmp, base, max_steps=12, eval_interval=6), run_dir=tmp / "run", **quiet())
    return tmp / "run"


def keys(path: Path) -> tuple[set[str], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys()), f.metadata() or {}


def test_only_adapters_are_optimised_and_saved_and_the_base_stays(base, tuned):
    names, meta = keys(tuned / "model.safetensors")
    assert names and all(".parametrizations.weight.0." in n for n in names)
    assert meta.get("llmkit.adapters")
    ckpt = sorted((tuned / "checkpoints").glob("step-*"))[-1]
    assert keys(ckpt / "model.safetensors")[0] == names
    moments = torch.load(ckpt / "state.pt", weights_only=True)["optimizer"]["state"]
    assert len(moments) == len(names)  # one optimizer entry per adapter tensor
    loaded = load_run(tuned)
    original = load_run(base).model.state_dict()
    state = loaded.model.state_dict()
    for name, value in original.items():  # base weights frozen: identical after training
        key = name.replace(".weight", ".parametrizations.weight.original")
        assert torch.equal(state.get(name, state.get(key)), value), name
    lora = loaded.model.layers[0].attn.qkv.parametrizations.weight[0]
    assert lora.B.abs().sum() > 0  # the adapters learned something


def test_merged_and_attached_generate_and_evaluate_alike(tuned, tmp_path, capsys):
    out = tmp_path / "merged"
    assert main(["merge-lora", str(tuned), str(out)]) == 0
    assert "merged adapters of 6 layers" in capsys.readouterr().out
    spec = yaml.safe_load((out / "spec.yaml").read_text())
    assert "adapter" not in spec["model"] and "init_from" not in spec["train"]
    names, meta = keys(out / "model.safetensors")
    assert not meta.get("llmkit.adapters") and "layers.0.attn.qkv.weight" in names
    a, m = load_run(tuned), load_run(out)
    x = torch.randint(0, a.spec.model.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(a.model(x).logits, m.model(x).logits, rtol=1e-5, atol=1e-5)
    prompt = "Tea for"
    greedy = Sampling(temperature=0.0, max_new_tokens=24)
    ga = Generator(a.model, a.tokenizer).generate([prompt], greedy)
    gm = Generator(m.model, m.tokenizer).generate([prompt], greedy)
    assert ga == gm
    capsys.readouterr()
    assert main(["eval", str(tuned), "--json"]) == 0
    ev_a = json.loads(capsys.readouterr().out.split("\n}")[0] + "\n}")
    assert main(["eval", str(out), "--json"]) == 0
    ev_m = json.loads(capsys.readouterr().out.split("\n}")[0] + "\n}")
    assert ev_a["loss"] == pytest.approx(ev_m["loss"], abs=1e-5)
    # The merged run is a plain run: a new run may start from it (not from adapters alone).
    spec2 = write_train_spec(tmp_path / "s", CORPUS, max_steps=2, eval_interval=2)
    train(spec2, run_dir=tmp_path / "again", overrides=[f"train.init_from={out}"], **quiet())
    with pytest.raises(LlmkitError, match="holds only adapter weights"):
        train(spec2, run_dir=tmp_path / "no", overrides=[f"train.init_from={tuned}"], **quiet())


def test_merge_errors(base, tuned, tmp_path, capsys):
    assert main(["merge-lora", str(base), str(tmp_path / "x")]) == 2
    assert "has no adapters" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert main(["merge-lora", str(tuned), str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_an_adapter_needs_base_weights(tmp_path):
    spec = write_train_spec(tmp_path, CORPUS, max_steps=2, eval_interval=2)
    with pytest.raises(LlmkitError, match=r"model\.adapter: adapters need train\.init_from"):
        train(spec, run_dir=tmp_path / "run", overrides=["model.adapter.name=lora"], **quiet())
    assert not (tmp_path / "run" / "data").exists()


@pytest.mark.parametrize("name", ["lora", "dora"])
def test_a_run_with_adapters_resumes_exactly(base, tmp_path, name):
    spec = lora_spec(
        tmp_path / "s",
        base,
        {**ADAPTER, "name": name},
        max_steps=16,
        eval_interval=8,
        checkpoint_interval=4,
    )
    full, run, killed_at = train_killed_and_resumed(spec, tmp_path, kill_at=4)
    assert killed_at < 16
    assert losses(run) == losses(full) and len(losses(full)) == 16
    assert val_losses(run) == val_losses(full)


def test_the_base_run_is_left_untouched(base, tmp_path):
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in base.rglob("*") if p.is_file()}
    train(
        lora_spec(tmp_path, base, max_steps=2, eval_interval=2), run_dir=tmp_path / "r", **quiet()
    )
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in base.rglob("*") if p.is_file()}
    assert after == before


def test_decoding_computes_each_adapted_weight_once(tuned, monkeypatch):
    from llmkit.components.adapter.lora import LoRA

    run = load_run(tuned)
    calls: list[int] = []
    real = LoRA.forward
    monkeypatch.setattr(LoRA, "forward", lambda self, w: calls.append(1) or real(self, w))
    Generator(run.model, run.tokenizer).generate(
        ["Tea"], Sampling(temperature=0.0, max_new_tokens=10)
    )
    assert len(calls) == 6  # 2 layers × (qkv, ffn in, ffn out), not once per token


def test_adapters_on_a_resized_vocabulary_train_and_keep_the_new_rows(base, tmp_path):
    # A chat template adds tokens: their embedding rows start random, so they train with
    # the adapters and are saved with them; every load of the run is then the same model.
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"prompt": "tea for?", "response": "two"})
                              for _ in range(60)))  # fmt: skip
    spec = lora_spec(tmp_path, base, init_resize_vocab=True, max_steps=3, eval_interval=3)
    data = yaml.safe_load(spec.read_text())
    data["data"] = {"source": {"name": "chat", "paths": [str(chat)], "template": "chatml"}}
    spec.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    train(spec, run_dir=run, **quiet())
    names, meta = keys(run / "model.safetensors")
    assert "tok_emb.weight" in names and meta  # saved with the adapters
    x = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        first, second = (load_run(run).model(x).logits for _ in range(2))
    assert torch.equal(first, second)
