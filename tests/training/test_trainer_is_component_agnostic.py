"""The trainer knows no concrete component (DESIGN: "Side outputs without trainer changes"):
no module of llmkit.training imports or names the MoE block or a concrete loss, yet an MoE
model's auxiliary losses and metrics reach metrics.jsonl through the model output's generic
side channel."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import yaml

import llmkit.training
from llmkit.training import train

TRAINING = Path(llmkit.training.__file__).parent
PACKAGE = TRAINING.parent
#: The training wing, and what it uses from below to compute and report its losses.
FILES = [*sorted(TRAINING.glob("*.py")), PACKAGE / "model/objective.py"]
FILES += [PACKAGE / "evaluation/perplexity.py", PACKAGE / "runs/metrics.py"]
SOURCES = {str(p.relative_to(PACKAGE)): p.read_text(encoding="utf-8") for p in FILES}


def imported_modules(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_trainer_never_names_a_concrete_component():
    assert {"training/trainer.py", "training/step.py", "model/objective.py"} <= set(SOURCES)
    for name, source in SOURCES.items():
        lowered = source.lower()
        for word in ("moe", "llmkit_losses", "z_loss", "label_smoothing"):
            assert word not in lowered, f"{name} names {word}"
        imports = imported_modules(source)
        assert "llmkit.components.ffn.moe" not in imports, name
        concrete = [m for m in imports if m.startswith("llmkit.components")]
        assert not concrete, f"{name} imports components: {concrete}"


def test_an_moe_model_reports_its_losses_and_metrics_through_the_trainer(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\nclass Point:\n    pass\n\n" * 80)
    spec = {
        "name": "moe-unit",
        "model": {
            "vocab_size": 64,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 2,
            "max_seq_len": 32,
            "position": {"name": "rope"},
            "overrides": [
                {
                    "layers": "1::2",
                    "ffn": {
                        "name": "moe",
                        "num_experts": 4,
                        "top_k": 2,
                        "capacity_factor": 1.0,
                        "expert": {"name": "mlp", "activation": "silu", "hidden": 32},
                    },
                }
            ],
        },
        "tokenizer": {"kind": "char"},
        "data": {"source": {"name": "text", "paths": [str(corpus)], "val_fraction": 0.1}},
        "optimizer": {"name": "adamw", "lr": 3e-3},
        "schedule": {"name": "constant"},
        "train": {
            "batch_size": 4,
            "max_steps": 4,
            "eval_interval": 4,
            "eval_batches": 1,
            "log_interval": 1,
            "precision": "fp32",
            "device": "cpu",
            "sample_tokens": 0,
        },
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = train(path, run_dir=tmp_path / "run", log=lambda _m: None, progress=False)
    assert result.step == 4
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert len(steps) == 4
    prefix = "layers.1.ffn"
    for line in steps:
        assert line[f"aux/{prefix}.load_balance"] > 0
        assert line[f"aux/{prefix}.z_loss"] > 0
        for name in ("expert_load_max", "expert_load_min", "expert_load_cv", "router_entropy"):
            assert f"metric/{prefix}.{name}" in line, name
        assert 0.0 <= line[f"metric/{prefix}.dropped_fraction"] < 1.0
        assert not any(key.startswith(("aux/layers.0", "metric/layers.0")) for key in line)
