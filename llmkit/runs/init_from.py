"""Starting a new run from another run's weights (``train.init_from``).

A source is a run directory (its final weights, else its latest checkpoint), a checkpoint
directory inside a run (``<run>/checkpoints/step-N``) or a bare ``.safetensors`` file. The
source is only read: nothing in it is written, moved or locked. The new run gets the weights
and, unless its spec names a tokenizer, the source's tokenizer (the ids must mean the same
tokens); its optimizer, schedule and step count start fresh.

Every tensor must match the model by name and shape; the one allowed difference is the
vocabulary (``train.init_resize_vocab``): rows of vocabulary-indexed tensors (the embedding,
an untied head and its bias) are copied for the ids both share, and new rows keep the
model's fresh initialisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llmkit.errors import LlmkitError
from llmkit.runs import TOKENIZER_FILE
from llmkit.runs.checkpoints import ADAPTER_MARK, is_adapter_file, read_weights

__all__ = ["ADAPTER_MARK", "InitSource", "find_init_source", "load_init_weights"]


@dataclass(frozen=True)
class InitSource:
    """Where a run's initial weights come from."""

    path: Path  # as the user named it, made absolute
    weights: Path
    run_dir: Path | None = None
    tokenizer: Path | None = None


def find_init_source(path: str | Path) -> InitSource:
    """The weights (and tokenizer, when there is one) ``path`` names; a one-line error when
    it names nothing loadable."""
    from llmkit.runs import open_run

    p = Path(path).expanduser().absolute()
    if not p.exists():
        raise LlmkitError(f"train.init_from: {p} not found")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise LlmkitError(
                f"train.init_from: {p} is not a run, a checkpoint or a .safetensors file"
            )
        return InitSource(p, p, None, _tokenizer_beside(p))
    try:
        run = open_run(p)
    except LlmkitError as exc:
        raise LlmkitError(f"train.init_from: {exc}") from exc
    weights = run.weights("final")
    tok = run.dir / TOKENIZER_FILE
    return InitSource(p, weights, run.dir, tok if tok.is_file() else None)


def _tokenizer_beside(weights: Path) -> Path | None:
    """The tokenizer of a weights file: in its directory, else (a checkpoint's weights) in
    the run that directory belongs to."""
    from llmkit.runs import open_run

    tok = weights.parent / TOKENIZER_FILE
    if tok.is_file():
        return tok
    try:
        tok = open_run(weights.parent).dir / TOKENIZER_FILE
    except LlmkitError:
        return None
    return tok if tok.is_file() else None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a full weights file; refuses a file of adapter weights only."""
    if is_adapter_file(path):
        raise LlmkitError(
            f"train.init_from: {path} holds only adapter weights; merge them into a full "
            "model first (llmkit merge-lora RUN OUT) and start from that"
        )
    return read_weights(path)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


@torch.no_grad()
def load_init_weights(
    model: nn.Module, source: InitSource, *, vocab_size: int, resize_vocab: bool = False
) -> str:
    """Copy the source's weights into ``model`` (before any wrapping or adapters); returns a
    line saying what was loaded. Refuses a missing, unexpected or differently shaped tensor
    by name; with ``resize_vocab`` the vocabulary dimension (rows) may differ."""
    tensors = read_tensors(source.weights)
    where = f"train.init_from {source.path}"
    params = dict(model.state_dict(keep_vars=True))
    loaded_ptrs = {params[k].data_ptr() for k in tensors if k in params}
    unexpected = sorted(k for k in tensors if k not in params)
    missing = sorted(
        k for k, v in params.items() if k not in tensors and v.data_ptr() not in loaded_ptrs
    )
    if unexpected:
        raise LlmkitError(
            f"{where}: the source has {len(unexpected)} tensor(s) this model lacks, e.g. "
            f"{unexpected[0]} {_shape(tensors[unexpected[0]])}: the architectures differ"
        )
    if missing:
        raise LlmkitError(
            f"{where}: this model's {missing[0]} {_shape(params[missing[0]])} is not in the "
            f"source ({len(missing)} missing): the architectures differ"
        )
    shared: dict[int, str] = {}  # one tensor under two names (a tied embedding and head)
    for name in (k for k in params if k in tensors):
        first = shared.setdefault(params[name].data_ptr(), name)
        if first != name and not torch.equal(tensors[first], tensors[name]):
            raise LlmkitError(
                f"{where}: this model ties {first} and {name}, the source holds two different "
                "tensors: set model.tie_embeddings = false as the source has it"
            )
    plan: list[tuple[str, int | None]] = []  # (name, rows to copy; None = all)
    for name in (k for k in params if k in tensors):  # the model's order
        src, dst = tensors[name], params[name]
        if _shape(src) == _shape(dst):
            plan.append((name, None))
            continue
        vocab_rows = (
            src.dim() == dst.dim()
            and _shape(src)[1:] == _shape(dst)[1:]
            and dst.shape[0] == vocab_size
        )
        differ = f"{where}: {name} is {_shape(src)} in the source and {_shape(dst)} in this model"
        if not vocab_rows:
            raise LlmkitError(differ)
        if not resize_vocab:
            raise LlmkitError(
                f"{differ}: the vocabularies differ ({src.shape[0]} vs {dst.shape[0]}); set "
                "train.init_resize_vocab = true to keep the shared rows"
            )
        plan.append((name, min(src.shape[0], dst.shape[0])))
    resized: list[str] = []
    for name, rows in plan:  # nothing is copied before everything was checked
        src, dst = tensors[name], params[name]
        if rows is None:
            dst.copy_(src.to(dst.dtype))
        else:
            dst[:rows].copy_(src[:rows].to(dst.dtype))
            resized.append(f"{name} {src.shape[0]}->{dst.shape[0]} rows")
    line = f"init_from: {len(tensors)} tensors from {source.weights}"
    if resized:
        line += f" (resized: {', '.join(resized)})"
    return line
