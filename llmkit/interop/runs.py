"""Hugging Face checkpoint directories to llmkit runs (:func:`import_hf`) and back
(:func:`export_hf`).

An imported run is a normal run directory (``spec.yaml``, ``resolved.json``,
``model.safetensors``, ``tokenizer.json``), plus ``hf_source.json``: where it came from, the
checkpoint's dtype, its special token ids and generation config, which export writes back.

Export writes a native family's checkpoint where one holds the model, else llmkit's
remote-code checkpoint (:mod:`llmkit.interop.remote`); :class:`Exported` says which.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmkit.errors import LlmkitError
from llmkit.interop import hf_files, remote
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


def import_hf(hf_dir: str | Path, out: str | Path, *, attention: str = "sdpa") -> Imported:
    """Write the local HF checkpoint ``hf_dir`` as the llmkit run ``out`` (absent or empty)."""
    from llmkit.runs import save_spec
    from llmkit.runs.checkpoints import save_weights
    from llmkit.spec import resolve

    src, out = Path(hf_dir).expanduser(), Path(out).expanduser()
    check_empty_output(out)
    imported = hf_to_llmkit(src, attention=attention)
    tok = read_hf_tokenizer(src)
    raw = dict(imported.raw)
    raw["name"] = out.name
    raw["description"] = f"imported from {src} ({imported.config.get('model_type')})"
    raw["tokenizer"] = _tokenizer_table(tok)
    rs = resolve(json.loads(json.dumps(raw)), source=str(out / "spec.yaml"))
    out.mkdir(parents=True, exist_ok=True)
    save_spec(rs, out)
    save_weights(imported.model, out / "model.safetensors")
    if tok is not None:
        write_run_tokenizer(tok, out)
        if tok.adds_bos:
            imported.notes.append(
                f"transformers puts {tok.bos_token!r} before every text; llmkit adds no BOS: "
                "begin prompts and data with it"
            )
    else:
        imported.notes.append(f"{src} has no tokenizer files: the run has weights only")
    generation = src / hf_files.GENERATION_CONFIG
    source = {
        "source": str(src.resolve()),
        "model_type": imported.config.get("model_type"),
        "architectures": imported.config.get("architectures"),
        "torch_dtype": imported.source_dtype,
        "adds_bos": bool(tok and tok.adds_bos),
        "bos_token": tok.bos_token if tok else None,
        **{k: imported.config[k] for k in TOKEN_IDS if imported.config.get(k) is not None},
        "generation_config": hf_files.read_json(generation) if generation.is_file() else None,
    }
    hf_files.write_json(out / SOURCE_FILE, source)
    imported.raw, imported.spec = raw, rs
    return imported


def _dtype(name: str, source: dict[str, Any]) -> torch.dtype:
    if name == "auto":
        name = str(source.get("torch_dtype") or "float32")
    if name not in DTYPES:
        raise LlmkitError(f"dtype {name!r}: choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


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
    from llmkit.interop.hf_tokenizer import write_hf_tokenizer
    from llmkit.runs import ADAPTER_SECTION, TOKENIZER_FILE, build_run_model, open_run
    from llmkit.runs.checkpoints import load_weights

    out = Path(out).expanduser()
    check_empty_output(out)
    found = open_run(run)
    rs = found.resolve()
    if ADAPTER_SECTION in rs.components:
        raise LlmkitError(f"{found.dir} has adapters: merge them first (llmkit merge-lora RUN OUT)")
    model, _ = build_run_model(rs, load_base=False)
    load_weights(model, found.weights(which))
    source_file = found.dir / SOURCE_FILE
    source = hf_files.read_json(source_file) if source_file.is_file() else {}
    cfg, tensors = llmkit_to_hf(
        model, rs, _dtype(dtype, source), source.get("model_type"), remote_code=not native_only
    )
    has_tokenizer = (found.dir / TOKENIZER_FILE).is_file()
    tok = found.tokenizer(rs) if has_tokenizer else None
    eos = tok.eos_id if tok is not None else None
    ids = {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": None}
    ids |= {k: source[k] for k in TOKEN_IDS if k in source}
    cfg |= {k: v for k, v in ids.items() if v is not None}
    out.mkdir(parents=True, exist_ok=True)
    hf_files.write_json(out / hf_files.CONFIG, cfg)
    hf_files.write_weights(tensors, out)
    generation = source.get("generation_config") or {k: v for k, v in ids.items() if v is not None}
    hf_files.write_json(out / hf_files.GENERATION_CONFIG, generation)
    written = [hf_files.CONFIG, hf_files.SAFETENSORS, hf_files.GENERATION_CONFIG]
    if remote.is_remote(cfg):
        written += remote.write_code(out)
    if tok is not None:
        written += write_hf_tokenizer(
            found.dir,
            out,
            eos_token=tok.eos_token,
            bos_token=source.get("bos_token"),
            model_max_length=rs.model.max_seq_len,
        )
    return Exported(written, cfg["model_type"], cfg["architectures"][0], remote.is_remote(cfg))
