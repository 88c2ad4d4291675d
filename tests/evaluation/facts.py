"""A synthetic task no model passes by chance: made-up countries and their capitals.

A corpus states each fact many times; the task asks for each country's capital among four
(multiple choice) or as the greedy continuation (completion). A model trained a little on
the corpus knows them; a random model scores near chance (1/4).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import yaml

SYLLABLES = ["bor", "vi", "ten", "lak", "mu", "ra", "zen", "dol", "pa", "qui", "sor", "el"]


def _name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in taken:
            taken.add(name)
            return name


def facts(n: int = 24, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (country, capital) pairs, every name distinct."""
    rng, taken = random.Random(seed), set[str]()
    return [(_name(rng, taken), _name(rng, taken)) for _ in range(n)]


def write_facts(directory: Path, n: int = 24, repeats: int = 120) -> dict[str, Path]:
    """The corpus, the multiple-choice and completion JSONL files and their task specs."""
    directory.mkdir(parents=True, exist_ok=True)
    pairs = facts(n)
    rng = random.Random(1)
    lines = [f"The capital of {c} is {k}." for c, k in pairs] * repeats
    rng.shuffle(lines)
    corpus = directory / "facts.txt"
    corpus.write_text("\n".join(lines) + "\n")
    capitals = [k for _, k in pairs]
    mc, comp = directory / "capitals_mc.jsonl", directory / "capitals_gen.jsonl"
    with mc.open("w") as fmc, comp.open("w") as fgen:
        for country, capital in pairs:
            others = rng.sample([k for k in capitals if k != capital], 3)
            options = [*others, capital]
            rng.shuffle(options)
            doc = {"country": country, "options": options, "answer": options.index(capital)}
            fmc.write(json.dumps(doc) + "\n")
            fgen.write(json.dumps({"country": country, "capital": capital}) + "\n")
    mc_spec = directory / "capitals_mc.toml"
    mc_spec.write_text(
        'name = "capitals"\nformat = "multiple_choice"\ndata = "capitals_mc.jsonl"\n'
        'context = "The capital of {{ country }} is"\nchoices = "options"\n'
        'gold = "{{ answer }}"\n'
    )
    gen_spec = directory / "capitals_gen.toml"
    gen_spec.write_text(
        'name = "capitals_gen"\nformat = "completion"\ndata = "capitals_gen.jsonl"\n'
        'context = "The capital of {{ country }} is"\ncontinuation = "{{ capital }}."\n'
    )
    return {"corpus": corpus, "mc": mc, "gen": comp, "mc_spec": mc_spec, "gen_spec": gen_spec}


def facts_train_spec(directory: Path, corpus: Path, *, max_steps: int) -> Path:
    """A char-level spec for a small model over the facts corpus."""
    spec = {
        "name": "facts",
        "model": {
            "vocab_size": 64,
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": 64,
            "position": {"name": "rope"},
        },
        "tokenizer": {"kind": "char", "special_tokens": ["<|endoftext|>"]},
        "data": {"source": {"name": "text", "paths": [str(corpus)], "val_fraction": 0.05}},
        "optimizer": {"name": "adamw", "lr": 3e-3},
        "schedule": {"name": "cosine", "warmup_steps": 20},
        "train": {
            "batch_size": 16,
            "max_steps": max_steps,
            "eval_interval": max_steps,
            "eval_batches": 2,
            "log_interval": 50,
            "precision": "fp32",
            "sample_tokens": 0,
            "seed": 0,
        },
    }
    path = directory / "facts.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path
