"""Reading and writing the files of a Hugging Face checkpoint directory, locally only.

Weights: ``model.safetensors``; sharded ``model-0000x-of-0000n.safetensors`` with
``model.safetensors.index.json``; or ``pytorch_model.bin`` (sharded with
``pytorch_model.bin.index.json``) read through ``torch.load(weights_only=True)``, which
refuses pickled code. Nothing here calls a hub or the network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llmkit.data.tokenizer import read_json_object
from llmkit.errors import LlmkitError, first_line

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
GENERATION_CONFIG = "generation_config.json"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a one-line error naming the file otherwise."""
    data = read_json_object(path)
    if data is None:
        raise LlmkitError(f"{path}: missing")
    return data


def read_config(hf_dir: Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory."""
    if not hf_dir.is_dir():
        raise LlmkitError(f"{hf_dir}: not a directory (a local Hugging Face checkpoint)")
    return read_json(hf_dir / CONFIG)


def _shards(hf_dir: Path, index_name: str) -> list[Path]:
    index = read_json(hf_dir / index_name)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise LlmkitError(f"{hf_dir / index_name}: no weight_map")
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (hf_dir / f).is_file()]
    if missing:
        raise LlmkitError(f"{hf_dir}: shard {missing[0]} named by {index_name} is missing")
    return [hf_dir / f for f in files]


def weight_files(hf_dir: Path) -> list[Path]:
    """The weight files of a checkpoint, safetensors preferred."""
    if (hf_dir / SAFETENSORS).is_file():
        return [hf_dir / SAFETENSORS]
    if (hf_dir / SAFETENSORS_INDEX).is_file():
        return _shards(hf_dir, SAFETENSORS_INDEX)
    if (hf_dir / TORCH_BIN).is_file():
        return [hf_dir / TORCH_BIN]
    if (hf_dir / TORCH_BIN_INDEX).is_file():
        return _shards(hf_dir, TORCH_BIN_INDEX)
    raise LlmkitError(
        f"{hf_dir}: no weights ({SAFETENSORS}, {SAFETENSORS_INDEX}, {TORCH_BIN} or "
        f"{TORCH_BIN_INDEX})"
    )


def _read_one(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise LlmkitError(f"{path}: not a readable safetensors file ({exc})") from exc
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle errors have no common base
        raise LlmkitError(f"{path}: not loadable as weights only ({first_line(exc)})") from exc
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise LlmkitError(f"{path}: not a state dict of tensors")
    return data


def read_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(hf_dir):
        tensors.update(_read_one(path))
    return tensors


def write_weights(tensors: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """One ``model.safetensors`` (contiguous copies; HF's ``format: pt`` metadata)."""
    from safetensors.torch import save_file

    path = out_dir / SAFETENSORS
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path), {"format": "pt"})
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
