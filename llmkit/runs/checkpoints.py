"""Checkpoints: weights as safetensors, trainer state loadable without unpickling code.

Layout of ``<run>/checkpoints/``::

    step-000400/model.safetensors   weights
    step-000400/state.pt            optimizer, data position, RNG, counters (weights_only)
    step-000400/meta.json           step, val loss, time, SHA-256 of every other file
    step-000400/rank-00001.pt       each rank's RNG state (multi-process runs)
    step-000400/dcp/                model + optimizer shards (FSDP, torch.distributed.checkpoint)
    latest.json, best.json          pointers, each replaced atomically

A checkpoint directory is written under a temporary name and renamed into place, then the
pointer is replaced with ``os.replace``: a crash at any moment leaves the previous
``latest`` intact and loadable. In a multi-process run every rank writes its part into the
temporary directory, and rank 0 renames it only after all ranks are done (a barrier).
Running out of space while writing raises :class:`NoSpaceLeft` naming the file, after the
temporary directory is removed. Files are created with the usual permissions (the umask).
Nothing here unpickles: ``state.pt`` and rank files load with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_file, save_model
from torch import nn

from llmkit.errors import LlmkitError, first_line, no_space_message
from llmkit.files import NoSpaceLeft, replacing, write_json_atomic, writing

WEIGHTS = "model.safetensors"
STATE = "state.pt"
META = "meta.json"
SHARDS = "dcp"
#: The key of ``meta.json`` holding the SHA-256 of each file, by path inside the checkpoint.
CHECKSUMS = "files"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_umask_allows(path: Path) -> None:
    """Give ``path`` the permissions a new file gets (0644 under umask 022): safetensors
    creates its files 0600."""
    os.chmod(path, 0o666 & ~_umask())


class _KeepsError:
    """A binary file for ``torch.save`` that keeps the ``OSError`` of a failed write: torch
    reports one only as a RuntimeError without its errno."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()


def save_tensors(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)``; a full disk raises :class:`NoSpaceLeft` naming ``path``."""
    with writing(path), open(path, "wb") as fh:
        out = _KeepsError(fh)
        try:
            torch.save(obj, out)
        except Exception as exc:
            if out.error is not None:
                raise out.error from exc
            raise


def sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def rank_file(rank: int) -> str:
    """The per-rank state file's name in a checkpoint directory."""
    return f"rank-{rank:05d}.pt"


#: safetensors metadata key marking a file that holds only a run's trainable adapter state.
ADAPTER_MARK = "llmkit.adapters"


def write_weights(model: nn.Module, path: Path) -> None:
    """Weights to safetensors (tied tensors handled); for a model with adapters only its
    trainable state (the adapters and ``also_train``), marked as such."""
    from llmkit.model.adapters import has_adapters, trainable_state

    with writing(path):
        if has_adapters(model):
            save_file(trainable_state(model), str(path), metadata={ADAPTER_MARK: "1"})
        else:
            save_model(model, str(path))
    as_umask_allows(path)


def save_weights(model: nn.Module, path: Path) -> None:
    """:func:`write_weights`, atomically: a failed write (a full disk: :class:`NoSpaceLeft`
    naming ``path``) leaves the previous file and no temporary."""
    with replacing(path) as tmp:
        try:
            write_weights(model, tmp)
        except NoSpaceLeft as exc:
            raise NoSpaceLeft(f"{no_space_message(path)}; nothing was written") from exc


class DamagedCheckpoint(LlmkitError):
    """A checkpoint file that cannot be read: truncated, overwritten or not its format."""


def _unreadable(exc: Exception) -> bool:
    """True for a file whose bytes are not its format; False for a failing disk, memory or
    file system (OSError, MemoryError), which must not make a run drop a good checkpoint."""
    return not isinstance(exc, OSError | MemoryError)


def load_weights(model: nn.Module, path: Path) -> None:
    """Load a safetensors file into ``model``: :class:`DamagedCheckpoint` when the file cannot
    be read, :class:`LlmkitError` when its tensors do not fit the model. A model with
    adapters loads a file of its trainable state (:func:`write_weights`)."""
    from llmkit.model.adapters import has_adapters, load_trainable_state

    adapted = has_adapters(model)
    if adapted or is_adapter_file(path):
        if not (adapted and is_adapter_file(path)):
            what = "adapter weights only" if not adapted else "full weights"
            raise LlmkitError(
                f"{path} holds {what}, which do not fit this model "
                f"({'with' if adapted else 'without'} adapters)"
            )
        load_trainable_state(model, read_weights(path), str(path))
        return
    shapes = weight_shapes(path)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [k for k in shapes if k in own and shapes[k] != own[k]]
    if wrong:
        k = wrong[0]
        raise LlmkitError(
            f"{path}: weights do not match the model ({len(wrong)} tensors differ, e.g. {k} is "
            f"{shapes[k]} in the file and {own[k]} in the model)"
        )
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except Exception as exc:
        if not _unreadable(exc):
            raise
        raise DamagedCheckpoint(
            f"{path}: unreadable weights ({first_line(exc, typed=True)})"
        ) from exc
    if missing or unexpected:
        raise LlmkitError(
            f"{path}: weights do not match the model (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )


def is_adapter_file(path: Path) -> bool:
    """Whether a safetensors file holds only a run's adapter state (:data:`ADAPTER_MARK`)."""
    return bool(_header(path, lambda f: (f.metadata() or {}).get(ADAPTER_MARK)))


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on the CPU."""
    return _header(path, lambda f: {k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118


def _header(path: Path, read: Callable[[Any], Any]) -> Any:
    """``read(f)`` of the open safetensors file; :class:`DamagedCheckpoint` when it cannot
    be read."""
    if not path.is_file():
        raise DamagedCheckpoint(f"no weights at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return read(f)
    except Exception as exc:
        if not _unreadable(exc):
            raise
        raise DamagedCheckpoint(
            f"{path}: unreadable weights ({first_line(exc, typed=True)})"
        ) from exc


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors file's header (reads no tensor data)."""
    return _header(path, lambda f: {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [*random.getstate()[1], random.getstate()[2] or 0],
        "python_version": random.getstate()[0],
        "numpy": _numpy_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _numpy_state() -> dict[str, Any]:
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": float(cached),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    gauss = py[-1] if py[-1] != 0 else None
    random.setstate((state["python_version"], tuple(py[:-1]), gauss))
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpoints:
    """Writes and finds checkpoints of one run."""

    def __init__(self, run_dir: Path, keep: int = 2, keep_steps: Iterable[int] = ()) -> None:
        self.dir = run_dir / "checkpoints"
        self.keep = keep
        #: Checkpoints never pruned (``train.checkpoint_steps``: the steps runs branch from).
        self.kept = {f"step-{s:06d}" for s in keep_steps}

    def save(
        self,
        step: int,
        model: nn.Module | None,
        state: dict[str, Any],
        meta: dict[str, Any],
        *,
        best: bool = False,
        dist: Any = None,
        rank_state: dict[str, Any] | None = None,
        write_shards: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write checkpoint ``step``. With ``dist`` (a multi-process
        :class:`~llmkit.training.distributed.DistContext`) every rank calls this: rank 0 writes
        ``model`` (its full weights) and ``state``, each rank its ``rank_state``, and
        ``write_shards(dir)`` runs on every rank (sharded model/optimizer state)."""
        main = dist is None or dist.is_main
        name = f"step-{step:06d}"
        final = self.dir / name
        tmp = self.dir / f".tmp-{name}"
        if main:
            self.dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier(dist)
        try:
            if write_shards is not None:
                with writing(tmp / SHARDS):
                    write_shards(tmp / SHARDS)
            if rank_state is not None:
                save_tensors(rank_state, tmp / rank_file(dist.rank if dist is not None else 0))
            if main:
                if model is not None:
                    write_weights(model, tmp / WEIGHTS)
                save_tensors(state, tmp / STATE)
            _barrier(dist)  # every rank's files are in place
            if main:
                sums = {
                    p.relative_to(tmp).as_posix(): sha256(p)
                    for p in sorted(tmp.rglob("*"))
                    if p.is_file() and p.name != META
                }
                with writing(tmp / META):
                    text = json.dumps({"step": step, **meta, CHECKSUMS: sums}, indent=2)
                    (tmp / META).write_text(text + "\n")
        except BaseException as exc:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, NoSpaceLeft):
                previous = self.latest()
                kept = f"{previous.name} is still the latest" if previous else "none was saved"
                raise NoSpaceLeft(f"{exc}; checkpoint {name} not written ({kept})") from exc
            raise
        if main:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_json_atomic(self.dir / "latest.json", {"step": step, "dir": name, **meta})
            if best:
                write_json_atomic(self.dir / "best.json", {"step": step, "dir": name, **meta})
            self._prune()
        _barrier(dist)  # nobody reads `latest` before it moved
        return final

    def pointer_problem(self, which: str = "latest") -> str | None:
        """Why ``<which>.json`` cannot be followed (missing, damaged, names a directory that
        is gone), or None when it can — or when there is no checkpoint at all."""
        if not self.steps():
            return None
        path = self.dir / f"{which}.json"
        if not path.is_file():
            return f"{path} is missing"
        if self._pointer(which) is None:
            return f"{path} is damaged or names a checkpoint that is gone"
        return None

    def _pointer(self, which: str) -> Path | None:
        """The directory ``<which>.json`` names; None when it is missing, damaged or names a
        directory that is gone."""
        path = self.dir / f"{which}.json"
        try:
            name = json.loads(path.read_text())["dir"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(name, str) or not name.startswith("step-") or "/" in name:
            return None
        target = self.dir / name
        return target if target.is_dir() else None

    def steps(self) -> list[Path]:
        """Every checkpoint directory, oldest first (each complete: renamed in only when
        written)."""
        return sorted(p for p in self.dir.glob("step-*") if p.is_dir())

    def latest(self) -> Path | None:
        """What ``latest.json`` names, or the newest checkpoint when the pointer is damaged."""
        latest = self._pointer("latest")
        if latest is None:
            steps = self.steps()
            latest = steps[-1] if steps else None
        return latest

    def best(self) -> Path | None:
        return self._pointer("best")

    def newest_first(self) -> list[Path]:
        """Checkpoints to resume from, in order of preference: the latest, then the older ones."""
        latest = self.latest()
        older = [p for p in reversed(self.steps()) if p != latest]
        return ([latest] if latest is not None else []) + older

    def _prune(self) -> None:
        keep = {p.name for p in (self.latest(), self.best()) if p is not None} | self.kept
        steps = [p for p in self.steps() if p.name not in self.kept]
        keep.update(p.name for p in steps[-self.keep :])
        for p in steps:
            if p.name not in keep:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.dir.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def _barrier(dist: Any) -> None:
    if dist is not None:
        dist.barrier()


def load_state(ckpt_dir: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint, loaded without executing pickled code."""
    path = ckpt_dir / STATE
    if not path.is_file():
        raise DamagedCheckpoint(f"checkpoint {ckpt_dir} has no {STATE}")
    return load_tensors(path, "trainer state")


def read_meta(ckpt_dir: Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json``; :class:`DamagedCheckpoint` when missing or unreadable."""
    path = ckpt_dir / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise DamagedCheckpoint(f"checkpoint {ckpt_dir} has no {META}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise DamagedCheckpoint(f"{path}: unreadable ({first_line(exc, typed=True)})") from exc
    if not isinstance(meta, dict):
        raise DamagedCheckpoint(f"{path}: not a JSON object")
    return meta


def verify_files(ckpt_dir: Path, names: Iterable[str]) -> None:
    """Check each file ``names`` lists (paths inside the checkpoint; absent files are left to
    their reader) against the SHA-256 ``meta.json`` recorded when the checkpoint was written:
    :class:`DamagedCheckpoint` naming the first that differs. Checkpoints written before
    checksums were recorded pass unchecked."""
    meta = read_meta(ckpt_dir)
    if CHECKSUMS not in meta:
        return
    sums = meta[CHECKSUMS]
    if not isinstance(sums, dict):
        raise DamagedCheckpoint(f"{ckpt_dir / META}: {CHECKSUMS!r} is not a table of checksums")
    for name in names:
        path = ckpt_dir / name
        if not path.is_file():
            continue
        want = sums.get(name)
        if want is None:
            raise DamagedCheckpoint(f"{path}: not a file this checkpoint was written with")
        if sha256(path) != want:
            raise DamagedCheckpoint(
                f"{path}: contents differ from the SHA-256 in {META} (changed or damaged "
                "after it was written)"
            )


def shard_files(ckpt_dir: Path) -> list[str]:
    """The files of the checkpoint's FSDP shards (``dcp/``), by path inside the checkpoint."""
    return [
        p.relative_to(ckpt_dir).as_posix()
        for p in sorted((ckpt_dir / SHARDS).rglob("*"))
        if p.is_file()
    ]


def load_tensors(path: Path, what: str) -> Any:
    """A ``torch.save`` file loaded without executing pickled code; :class:`DamagedCheckpoint`
    when its bytes are not such a file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        if not _unreadable(exc):
            raise
        raise DamagedCheckpoint(
            f"{path}: unreadable {what} ({first_line(exc, typed=True)})"
        ) from exc
