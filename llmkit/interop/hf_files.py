"""Reading and writing the files of a Hugging Face checkpoint directory, locally only.

Weights: ``model.safetensors``; sharded ``model-0000x-of-0000n.safetensors`` with
``model.safetensors.index.json``; or ``pytorch_model.bin`` (sharded with
``pytorch_model.bin.index.json``) read through ``torch.load(weights_only=True)``, which
refuses pickled code (and only with torch ≥ 2.6, whose restricted unpickler has no known
escape). Nothing here calls a hub or the network.

A checkpoint is untrusted: every file it names must lie inside its directory
(:mod:`llmkit.interop.local_files`); a shard index must map tensor names (strings) to shard
names (strings) that hold them, and no tensor may be in two shards. :func:`open_weights`
reads only the files' headers (names, shapes, dtypes: for safetensors without touching the
data), so import can check them against the model, built on the meta device, before any
real allocation; :meth:`Weights.load` then reads the tensors it is asked for, refusing
NaN or infinite values by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmkit.errors import LlmkitError, first_line
from llmkit.interop import local_files
from llmkit.model.finite import first_nonfinite

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
GENERATION_CONFIG = "generation_config.json"
#: The oldest torch whose ``weights_only`` unpickler has no known way to run code
#: (CVE-2025-32434 was fixed in 2.6.0).
SAFE_UNPICKLER = (2, 6)
#: safetensors' dtype names as torch's.
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
}  # fmt: skip
FLOATING = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path`` (bounded in size and depth); a one-line error naming
    the file otherwise."""
    data = local_files.read_object(Path(path))
    if data is None:
        raise LlmkitError(f"{path}: missing")
    return data


def read_config(hf_dir: Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory."""
    if not hf_dir.is_dir():
        raise LlmkitError(f"{hf_dir}: not a directory (a local Hugging Face checkpoint)")
    data = local_files.checkpoint_object(hf_dir, CONFIG)
    if data is None:
        raise LlmkitError(f"{hf_dir / CONFIG}: missing")
    return data


def read_generation_config(hf_dir: Path) -> dict[str, Any] | None:
    """``generation_config.json`` of a checkpoint directory, None when it has none."""
    return local_files.checkpoint_object(hf_dir, GENERATION_CONFIG)


# -- the weight files -------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint as its file's header gives it."""

    shape: tuple[int, ...]
    dtype: str  #: torch's name (``bfloat16``), or the file's for a type torch lacks
    file: Path  #: as the checkpoint names it (for messages)

    @property
    def floating(self) -> bool:
        return self.dtype in FLOATING

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Weights:
    """A checkpoint's weight files: every tensor's header (:attr:`infos`), data on request
    (:meth:`load`)."""

    infos: dict[str, TensorInfo]
    real: dict[Path, Path]  #: each file as named → its resolved path
    pickled: dict[Path, dict[str, torch.Tensor]] = field(default_factory=dict)

    def load(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names``, read from their files; a tensor holding NaN or an
        infinity (or, from float64, a value beyond float32's range) is refused by name."""
        from safetensors import SafetensorError, safe_open

        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.infos[name].file, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path, wanted in by_file.items():
            if path in self.pickled:
                tensors = self.pickled[path]
                for name in wanted:
                    out[name] = check_finite(tensors[name], f"{path}: tensor {name!r}")
                continue
            try:
                with safe_open(str(self.real[path]), framework="pt") as f:
                    for name in wanted:
                        t = f.get_tensor(name)
                        out[name] = check_finite(t, f"{path}: tensor {name!r}")
            except (SafetensorError, OSError) as exc:
                raise LlmkitError(f"{path}: not a readable safetensors file ({exc})") from exc
        return out

    def load_all(self) -> dict[str, torch.Tensor]:
        return self.load(list(self.infos))


def finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or infinity (any non-float tensor does not), checked
    piece by piece."""
    return first_nonfinite(t) is None


def check_finite(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t``, when it holds no NaN or infinity (and, in float64, nothing beyond float32's
    range, where import puts it); a one-line error naming ``what`` otherwise."""
    limit = torch.finfo(torch.float32).max if t.dtype == torch.float64 else None
    if first_nonfinite(t, limit=limit) is not None:
        bad = "NaN or infinite values" if limit is None else "NaN, infinite or huge values"
        raise LlmkitError(f"{what} holds {bad}; refusing a checkpoint that cannot compute")
    return t


def _index(hf_dir: Path, index_name: str) -> dict[str, list[str]]:
    """The shard files of an index and the tensors it says each holds; every entry's type
    checked, every file inside the checkpoint."""
    path = hf_dir / index_name
    index = local_files.checkpoint_object(hf_dir, index_name)
    if index is None:
        raise LlmkitError(f"{path}: missing")
    metadata = index.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise LlmkitError(f"{path}: metadata must be an object, not {type(metadata).__name__}")
    total = (metadata or {}).get("total_size")
    if total is not None and (type(total) is not int or total < 0):
        raise LlmkitError(f"{path}: metadata.total_size must be a non-negative integer")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise LlmkitError(f"{path}: no weight_map (an object from tensor names to shard files)")
    shards: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise LlmkitError(
                f"{path}: weight_map[{tensor!r}] must be a shard file name, not {shard!r}"
            )
        if not tensor:
            raise LlmkitError(f"{path}: weight_map has an empty tensor name")
        shards.setdefault(shard, []).append(tensor)
    return shards


def _real_file(hf_dir: Path, name: str, what: str | None) -> Path:
    real = local_files.inside(hf_dir, name, what)
    if not real.is_file():
        where = f"{what}: {name!r}" if what else str(hf_dir / name)
        raise LlmkitError(f"{where} is missing (or not a file)")
    return real


def weight_files(hf_dir: Path) -> list[Path]:
    """The weight files of a checkpoint, safetensors preferred (each inside it)."""
    return list(open_weights(hf_dir, headers=False).real)


def _torch_load(path: Path, real: Path) -> dict[str, torch.Tensor]:
    """A pickled state dict through the weights-only unpickler, memory-mapped where the
    file allows (shapes known before the data is read)."""
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < SAFE_UNPICKLER:
        raise LlmkitError(
            f"{path}: a pickle, which torch {torch.__version__} cannot read safely (its "
            "weights_only loader can run code before 2.6): upgrade torch, or convert the "
            "checkpoint to safetensors"
        )
    import zipfile

    mmap = zipfile.is_zipfile(real)  # torch.save's format since 1.6; legacy files load whole
    try:
        data = torch.load(real, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # pickle errors have no common base
        raise LlmkitError(f"{path}: not loadable as weights only ({first_line(exc)})") from exc
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()
    ):
        raise LlmkitError(f"{path}: not a state dict of tensors")
    return data


def _safetensors_header(path: Path, real: Path) -> dict[str, TensorInfo]:
    from safetensors import SafetensorError, safe_open

    infos = {}
    try:
        with safe_open(str(real), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                part = f.get_slice(name)
                dtype = part.get_dtype()
                shape = tuple(int(d) for d in part.get_shape())
                infos[name] = TensorInfo(shape, SAFETENSORS_DTYPES.get(dtype, dtype), path)
    except (SafetensorError, OSError) as exc:
        raise LlmkitError(f"{path}: not a readable safetensors file ({exc})") from exc
    return infos


def _rel(hf_dir: Path, path: Path) -> str:
    return path.relative_to(hf_dir).as_posix()


def open_weights(hf_dir: Path, *, headers: bool = True) -> Weights:
    """The checkpoint's weight files and (``headers``) every tensor's name, shape and dtype,
    without reading tensor data from safetensors files. A shard index must name each
    tensor in the one shard that holds it."""
    hf_dir = Path(hf_dir)
    order = (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, TORCH_BIN_INDEX)
    kind = next((n for n in order if (hf_dir / n).is_file()), None)
    if kind is None:
        raise LlmkitError(
            f"{hf_dir}: no weights ({SAFETENSORS}, {SAFETENSORS_INDEX}, {TORCH_BIN} or "
            f"{TORCH_BIN_INDEX}; pickles under other names, .pt or .ckpt, are never read)"
        )
    pickled = kind in (TORCH_BIN, TORCH_BIN_INDEX)
    if kind in (SAFETENSORS, TORCH_BIN):
        named: dict[str, list[str] | None] = {kind: None}
    else:
        named = dict(_index(hf_dir, kind))
    weights = Weights({}, {})
    owner: dict[str, Path] = {}
    for name, listed in named.items():
        what = f"{hf_dir / kind}: the shard of {listed[0]!r}" if listed else None
        real = _real_file(hf_dir, name, what)
        path = hf_dir / name
        twice = [p for p, r in weights.real.items() if r == real]
        if twice:
            first = _rel(hf_dir, twice[0])
            raise LlmkitError(f"{hf_dir / kind}: {first!r} and {name!r} are one file")
        weights.real[path] = real
        if not headers:
            continue
        if pickled:
            tensors = _torch_load(path, real)
            weights.pickled[path] = tensors
            infos = {
                k: TensorInfo(tuple(v.shape), str(v.dtype).removeprefix("torch."), path)
                for k, v in tensors.items()
            }
        else:
            infos = _safetensors_header(path, real)
        for tensor, info in infos.items():
            if tensor in owner:
                raise LlmkitError(
                    f"tensor {tensor!r} is in two shards, {_rel(hf_dir, owner[tensor])} and "
                    f"{_rel(hf_dir, path)}; refusing to pick one"
                )
            owner[tensor] = path
            weights.infos[tensor] = info
        for tensor in listed or ():
            if tensor not in infos:
                raise LlmkitError(
                    f"{hf_dir / kind}: names {tensor!r} in {name}, which does not hold it"
                )
        if listed is not None:
            extra = sorted(set(infos) - set(listed))
            if extra:
                raise LlmkitError(
                    f"{path}: holds {extra[0]!r}, which {kind} does not name (or names "
                    "in another shard)"
                )
    return weights


def read_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by name (NaN/Inf refused)."""
    return open_weights(hf_dir).load_all()


def write_weights(tensors: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """One ``model.safetensors`` (contiguous copies; HF's ``format: pt`` metadata)."""
    from safetensors.torch import save_file

    path = out_dir / SAFETENSORS
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path), {"format": "pt"})
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
