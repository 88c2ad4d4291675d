"""Hugging Face checkpoint directories to llmkit runs (:func:`import_hf`) and back
(:func:`export_hf`).

An imported run is a normal run directory (``spec.yaml``, ``resolved.json``,
``model.safetensors``, ``tokenizer.json``), plus ``hf_source.json``: where it came from, the
checkpoint's dtype, its special token ids and generation config, which export writes back.

Export writes a native family's checkpoint where one holds the model, else llmkit's
remote-code checkpoint (:mod:`llmkit.interop.remote`); :class:`Exported` says which.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmkit.data.tokenizer import CONFIG_FILE
from llmkit.errors import LlmkitError
from llmkit.files import temporary_name, writing
from llmkit.interop import hf_files, local_files, remote
from llmkit.interop.convert import Imported, hf_to_llmkit, llmkit_to_hf
from llmkit.interop.hf_tokenizer import HFTokenizerFiles, read_hf_tokenizer, write_run_tokenizer
from llmkit.runs import check_empty_output

SOURCE_FILE = "hf_source.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Config keys naming special token ids, carried from import to export.
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _tokenizer_table(tok: HFTokenizerFiles | None) -> dict[str, Any]:
    table: dict[str, Any] = {"kind": tok.kind if tok and tok.kind in ("bpe", "char") else "bpe"}
    if tok is not None and tok.special_tokens:
        table["special_tokens"] = list(tok.special_tokens)
    return table


# -- writing a directory whole or not at all --------------------------------------------------


def _fresh(out: Path) -> Path:
    """A new, empty directory beside ``out`` (``.NAME.PID.tmp.N``), made with the usual
    permissions."""
    for i in range(1000):
        tmp = temporary_name(out, f".{i}")
        try:
            tmp.mkdir()
        except FileExistsError:
            continue
        return tmp
    raise LlmkitError(f"{out.parent}: cannot make a temporary directory for {out.name}")


def _place(tmp: Path, out: Path) -> None:
    """Rename the filled ``tmp`` to ``out`` (absent, or an empty directory)."""
    try:
        os.replace(tmp, out)  # POSIX renames over an empty directory
        return
    except OSError as exc:
        if not (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
            if out.exists() or out.is_symlink():
                raise LlmkitError(
                    f"{out} exists and is not empty; choose another output directory"
                ) from exc
            raise LlmkitError(f"{out}: cannot move the new directory there ({exc})") from exc
    out.rmdir()  # where a rename cannot replace a directory (Windows)
    os.replace(tmp, out)


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A new directory beside ``out`` for the body to fill, renamed to ``out`` when the body
    returns: a reader never sees half of it, and a failure (an error, a full disk, ^C)
    leaves ``out`` as it was (absent, or empty), the temporary directory and any parent
    directory made for it removed."""
    out = Path(os.path.abspath(out))
    if out.is_symlink():
        out = out.resolve()
    made = [p for p in out.parents if not p.exists()]  # the nearest first
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LlmkitError(f"{out.parent}: cannot create it ({exc.strerror or exc})") from exc
    tmp = _fresh(out)
    done = False
    try:
        with writing(out):
            yield tmp
            _place(tmp, out)
        done = True
    finally:
        if not done:
            shutil.rmtree(tmp, ignore_errors=True)
            for parent in made:
                try:
                    parent.rmdir()
                except OSError:
                    break


# -- import -----------------------------------------------------------------------------------


def _token_id(value: Any) -> bool:
    """An HF config's token id: an integer, or a list of them (Llama 3's EOS)."""
    if isinstance(value, list):
        return all(_token_id(v) and not isinstance(v, list) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(path: Path, data: dict[str, Any]) -> None:
    for key in TOKEN_IDS:
        value = data.get(key)
        if value is not None and not _token_id(value):
            raise LlmkitError(
                f"{path}: {key} must be an integer or a list of integers, not "
                f"{type(value).__name__}"
            )


def _check_vocabulary(src: Path, tok: HFTokenizerFiles, vocab_size: int) -> None:
    """Refuse a tokenizer with ids beyond the model's embedding (they would index past it
    in generate and eval)."""
    if tok.n_ids > vocab_size:
        raise LlmkitError(
            f"{src}: the tokenizer ({tok.source}) has {tok.n_ids} ids, added tokens "
            f"included, more than the model's vocab_size {vocab_size}: ids from {vocab_size} "
            "on have no embedding"
        )


def import_hf(hf_dir: str | Path, out: str | Path, *, attention: str = "sdpa") -> Imported:
    """Write the local HF checkpoint ``hf_dir`` as the llmkit run ``out`` (absent or empty).

    Every input is read and checked first (config, weights, tokenizer, generation config);
    the run is then written into a temporary directory beside ``out`` and renamed into
    place, so a failure leaves ``out`` as it was."""
    from llmkit.runs import save_spec
    from llmkit.runs.checkpoints import save_weights
    from llmkit.spec import resolve

    src, out = Path(hf_dir).expanduser(), Path(out).expanduser()
    check_empty_output(out)
    imported = hf_to_llmkit(src, attention=attention)
    _check_token_ids(src / hf_files.CONFIG, imported.config)
    tok = read_hf_tokenizer(src)
    if tok is not None:
        _check_vocabulary(src, tok, imported.spec.model.vocab_size)
    generation = hf_files.read_generation_config(src)
    raw = dict(imported.raw)
    raw["name"] = out.name
    raw["description"] = f"imported from {src} ({imported.config.get('model_type')})"
    raw["tokenizer"] = _tokenizer_table(tok)
    rs = resolve(json.loads(json.dumps(raw)), source=str(out / "spec.yaml"))
    source = {
        "source": str(src.resolve()),
        "model_type": imported.config.get("model_type"),
        "architectures": imported.config.get("architectures"),
        "torch_dtype": imported.source_dtype,
        "adds_bos": bool(tok and tok.adds_bos),
        "bos_token": tok.bos_token if tok else None,
        **{k: imported.config[k] for k in TOKEN_IDS if imported.config.get(k) is not None},
        "generation_config": generation,
    }
    with staged(out) as tmp:
        save_spec(rs, tmp)
        save_weights(imported.model, tmp / "model.safetensors")
        if tok is not None:
            write_run_tokenizer(tok, tmp)
        hf_files.write_json(tmp / SOURCE_FILE, source)
    if tok is None:
        imported.notes.append(f"{src} has no tokenizer files: the run has weights only")
    elif tok.adds_bos:
        imported.notes.append(
            f"transformers puts {tok.bos_token!r} before every text; llmkit adds no BOS: "
            "begin prompts and data with it"
        )
    imported.raw, imported.spec = raw, rs
    return imported


# -- export -----------------------------------------------------------------------------------


def _dtype(name: str, source: dict[str, Any]) -> torch.dtype:
    if name == "auto":
        name = str(source.get("torch_dtype") or "float32")
    if name not in DTYPES:
        raise LlmkitError(f"dtype {name!r}: choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _read_source(path: Path) -> dict[str, Any]:
    """A run's ``hf_source.json`` (``{}`` when it has none), every key export uses typed."""
    if not path.is_file():
        return {}
    source = hf_files.read_json(path)
    for key in ("model_type", "torch_dtype", "bos_token"):
        value = source.get(key)
        if value is not None and not isinstance(value, str):
            raise LlmkitError(f"{path}: {key} must be a string, not {type(value).__name__}")
    generation = source.get("generation_config")
    if generation is not None and not isinstance(generation, dict):
        raise LlmkitError(f"{path}: generation_config must be an object")
    _check_token_ids(path, source)
    return source


def _cast_checked(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype, run: Path
) -> dict[str, torch.Tensor]:
    """``tensors`` in ``dtype``; NaN/Inf in the run's weights, or values the cast makes
    infinite, refused by tensor (one at a time: no second copy of the model)."""
    out = {}
    for name, t in tensors.items():
        if not hf_files.finite(t):
            raise LlmkitError(
                f"{run}: tensor {name!r} holds NaN or infinite values (did training "
                "diverge?); refusing to export it"
            )
        cast = t.to(dtype)
        if not hf_files.finite(cast):
            kind = str(dtype).removeprefix("torch.")
            raise LlmkitError(
                f"{run}: tensor {name!r} has values beyond {kind}'s range (they would be "
                "infinite); export with --dtype float32 or bfloat16"
            )
        out[name] = cast
    return out


@dataclass
class Exported:
    """What :func:`export_hf` wrote: the files, the ``model_type`` and architecture, and
    whether it is llmkit's remote code (no native family holds the model)."""

    files: list[str]
    model_type: str
    architecture: str
    remote_code: bool

    def how(self) -> str:
        """``native family llama (LlamaForCausalLM)`` or the remote code and how to load it."""
        if self.remote_code:
            return (
                f"remote code ({self.architecture} in modeling_llmkit.py: no native family "
                "holds the model; load with trust_remote_code=True where llmkit is installed)"
            )
        return f"native family {self.model_type} ({self.architecture})"


def export_hf(
    run: str | Path,
    out: str | Path,
    *,
    dtype: str = "auto",
    which: str = "final",
    native_only: bool = False,
) -> Exported:
    """Write the run ``run`` as an HF checkpoint directory ``out`` (absent or empty) that
    ``transformers.AutoModelForCausalLM`` and ``AutoTokenizer`` load: with no custom code
    where a native family holds the model, else as llmkit's remote code (refused instead
    with ``native_only``)."""
    from llmkit.interop.hf_tokenizer import hf_tokenizer_files
    from llmkit.runs import ADAPTER_SECTION, TOKENIZER_FILE, build_run_model, open_run
    from llmkit.runs.checkpoints import load_weights

    out = Path(out).expanduser()
    check_empty_output(out)
    found = open_run(run)
    rs = found.resolve()
    if ADAPTER_SECTION in rs.components:
        raise LlmkitError(f"{found.dir} has adapters: merge them first (llmkit merge-lora RUN OUT)")
    source = _read_source(found.dir / SOURCE_FILE)
    target = _dtype(dtype, source)
    tok, tok_files = None, {}
    if (found.dir / TOKENIZER_FILE).is_file():
        local_files.read_object(found.dir / CONFIG_FILE)  # bounded JSON, before it is used
        tok = found.tokenizer(rs)
        tok_files = hf_tokenizer_files(
            found.dir,
            eos_token=tok.eos_token,
            bos_token=source.get("bos_token"),
            model_max_length=rs.model.max_seq_len,
        )
    model, _ = build_run_model(rs, load_base=False)
    load_weights(model, found.weights(which))
    cfg, tensors = llmkit_to_hf(
        model, rs, None, source.get("model_type"), remote_code=not native_only
    )
    tensors = _cast_checked(tensors, target, found.dir)
    cfg["torch_dtype"] = str(target).removeprefix("torch.")
    eos = tok.eos_id if tok is not None else None
    ids = {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": None}
    ids |= {k: source[k] for k in TOKEN_IDS if k in source}
    cfg |= {k: v for k, v in ids.items() if v is not None}
    generation = source.get("generation_config") or {k: v for k, v in ids.items() if v is not None}
    written = [hf_files.CONFIG, hf_files.SAFETENSORS, hf_files.GENERATION_CONFIG]
    with staged(out) as tmp:
        hf_files.write_json(tmp / hf_files.CONFIG, cfg)
        hf_files.write_weights(tensors, tmp)
        hf_files.write_json(tmp / hf_files.GENERATION_CONFIG, generation)
        if remote.is_remote(cfg):
            written += remote.write_code(tmp)
        for name, text in tok_files.items():
            (tmp / name).write_text(text, encoding="utf-8")
    written += list(tok_files)
    return Exported(written, cfg["model_type"], cfg["architectures"][0], remote.is_remote(cfg))
