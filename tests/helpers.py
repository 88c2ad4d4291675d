"""Small builders shared by tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from llmkit.components import builtin
from llmkit.registry import Registry


def tiny_spec(**model: Any) -> dict[str, Any]:
    """A spec dict for a tiny model; keyword arguments override model fields."""
    base: dict[str, Any] = {
        "vocab_size": 64,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "max_seq_len": 32,
        "attention": {"name": "sdpa"},
        "ffn": {"name": "mlp"},
        "norm": {"name": "layernorm"},
        "position": {"name": "learned"},
    }
    base.update(model)
    return {"model": base}


def registry_with(*plugins: Any) -> Registry:
    """A fresh registry holding the built-in plugin and the given plugin objects."""
    reg = Registry()
    reg.add_plugin(builtin, "builtin", "llmkit", "0")
    for i, plugin in enumerate(plugins):
        dist = getattr(plugin, "distribution", f"fake-{i}")
        reg.add_plugin(plugin, getattr(plugin, "name", f"fake{i}"), dist, "1.0")
    return reg


def write_train_spec(tmp_path: Path, corpus: str, *, dropout: float = 0.0, **train: Any) -> Path:
    """A char-level training spec over ``corpus`` (written beside it) for a tiny model with
    RoPE; keyword arguments override ``train`` fields."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = tmp_path / "corpus.txt"
    text.write_text(corpus)
    spec = {
        "name": "unit",
        "model": {
            "vocab_size": 64,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 2,
            "max_seq_len": 32,
            "dropout": dropout,
            "position": {"name": "rope"},
        },
        "tokenizer": {"kind": "char"},
        "data": {"source": {"name": "text", "paths": [str(text)], "val_fraction": 0.1}},
        "optimizer": {"name": "adamw", "lr": 3e-3},
        "schedule": {"name": "cosine", "warmup_steps": 2},
        "train": {
            "batch_size": 4,
            "max_steps": 20,
            "eval_interval": 10,
            "eval_batches": 2,
            "log_interval": 1,
            "precision": "fp32",
            "sample_tokens": 0,
            **train,
        },
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def spawn_workers(worker: Any, args: tuple[Any, ...], world: int, what: str) -> None:
    """Run ``worker(rank, *args)`` on ``world`` spawned processes of one thread each; fail the
    test (never hang) when they have not finished within two minutes."""
    import os
    import time

    import pytest
    import torch.multiprocessing as mp

    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers
    try:
        context = mp.start_processes(
            worker, args=args, nprocs=world, join=False, start_method="spawn"
        )
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world}-process {what} run did not finish in 120 s")


def init_gloo(rank: int, world: int, directory: str) -> None:
    """A spawned worker's gloo process group (one thread; a file store in ``directory``)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{directory}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
