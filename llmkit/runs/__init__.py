"""Run directories: their layout, saving the spec, and the one way to open a run again.

Layout of ``<run>/``::

    spec.yaml          the merged spec (extends and --set applied); reloadable
    resolved.json      every default and every layer's component spelled out
    tokenizer.json     the tokenizer the run trained or loaded
    metrics.jsonl      one JSON object per logged step and evaluation
    loss.png           the loss curve
    model.safetensors  the final weights
    checkpoints/       see :mod:`llmkit.runs.checkpoints`

:mod:`llmkit.runs.metrics` writes ``metrics.jsonl`` (and the trackers a spec names) and
draws ``loss.png``.

:func:`open_run` finds a run from its directory or one of its checkpoints and reads its spec;
everything that reads a run back — resuming training, generation, evaluation, benchmarks —
goes through it (:func:`load_run` adds the model's weights and the tokenizer).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmkit.data.tokenizer import CONFIG_FILE
from llmkit.errors import LlmkitError
from llmkit.runs.checkpoints import WEIGHTS, Checkpoints, load_weights
from llmkit.spec import ResolvedSpec, apply_override, load_raw, resolve

SPEC_FILE = "spec.yaml"  # the merged spec (extends and --set applied); reloadable
RESOLVED_FILE = "resolved.json"  # every default and every layer's component spelled out
TOKENIZER_FILE = "tokenizer.json"
#: The files that make a run's tokenizer: the vocabulary, and the chat template and token roles.
TOKENIZER_FILES = (TOKENIZER_FILE, CONFIG_FILE)
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


def check_empty_output(out: Path) -> None:
    """A new run or export directory must be absent or empty: nothing in it is overwritten."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LlmkitError(f"{out} exists and is not empty; choose another output directory")


def default_run_dir(rs: ResolvedSpec) -> Path:
    name = rs.spec.name or Path(rs.source or "run").stem
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def save_spec(rs: ResolvedSpec, run_dir: Path) -> None:
    (run_dir / SPEC_FILE).write_text(yaml.safe_dump(rs.raw, sort_keys=False))
    (run_dir / RESOLVED_FILE).write_text(json.dumps(rs.to_dict(), indent=2) + "\n")


@dataclass
class Run:
    """A run directory as found on disk: its spec as saved (not yet resolved), and the
    checkpoint directory it was opened at, if any."""

    dir: Path
    raw: dict[str, Any]
    checkpoint: Path | None = None

    @property
    def spec_file(self) -> Path:
        return self.dir / SPEC_FILE

    def resolve(self, overrides: list[str] | None = None, registry: Any = None) -> ResolvedSpec:
        """The run's spec with ``--set`` overrides, resolved (once per call)."""
        data = copy.deepcopy(self.raw)
        for assignment in overrides or []:
            apply_override(data, assignment)
        return resolve(data, source=str(self.spec_file), registry=registry)

    def weights(self, which: str = "final") -> Path:
        """The weights file: the checkpoint it was opened at, else the final weights
        (``which="final"``), the best checkpoint's or the latest one's; a run without final
        weights falls back to its latest (and best to latest) checkpoint."""
        if self.checkpoint is not None:
            return self.checkpoint / WEIGHTS
        if which == "final" and (self.dir / WEIGHTS).is_file():
            return self.dir / WEIGHTS
        ckpts = Checkpoints(self.dir)
        chosen = ckpts.best() if which == "best" else ckpts.latest()
        if chosen is None and which == "best":
            chosen = ckpts.latest()
        if chosen is None:
            raise LlmkitError(f"{self.dir}: the run has no weights yet")
        return chosen / WEIGHTS

    def tokenizer(self, rs: ResolvedSpec | None = None) -> Any:
        """The run's tokenizer; its EOS is the spec's first special token."""
        from llmkit.data.tokenizer import Tokenizer

        specials = (rs.spec if rs is not None else self.resolve().spec).tokenizer.special_tokens
        eos = specials[0] if specials else None
        return Tokenizer.load(self.dir / TOKENIZER_FILE, eos_token=eos)


def open_run(path: str | Path) -> Run:
    """The run at ``path``: a run directory, or a checkpoint directory inside one
    (``<run>/checkpoints/step-N``). Reads ``spec.yaml`` as the spec files are read, without
    resolving it."""
    p = Path(path)
    if not p.exists():
        raise LlmkitError(f"run not found: {p}")
    checkpoint = None
    in_run = (p / WEIGHTS).is_file() and (p.parent.parent / SPEC_FILE).is_file()
    if not (p / SPEC_FILE).is_file() and in_run:  # <run>/checkpoints/step-N
        p, checkpoint = p.parent.parent, p
    if not (p / SPEC_FILE).is_file():
        raise LlmkitError(f"{p} is not a run directory or checkpoint (no {SPEC_FILE})")
    return Run(p, load_raw(p / SPEC_FILE), checkpoint)


@dataclass
class LoadedRun:
    spec: ResolvedSpec
    model: Any
    tokenizer: Any
    weights: Path
    run_dir: Path


def find_weights(path: Path, which: str = "final") -> tuple[Path, Path]:
    """(run_dir, weights file) for a run directory or a checkpoint directory."""
    run = open_run(path)
    return run.dir, run.weights(which)


ADAPTER_SECTION = "model.adapter"


def adapter_base(rs: ResolvedSpec) -> str | None:
    """``train.init_from``, which a spec with ``model.adapter`` must name: the base weights
    its adapters adapt."""
    if ADAPTER_SECTION in rs.components and rs.spec.train.init_from is None:
        raise LlmkitError(
            "model.adapter needs train.init_from: the base weights the adapters adapt"
        )
    return rs.spec.train.init_from


def build_run_model(
    rs: ResolvedSpec, base: Any = None, *, load_base: bool = True
) -> tuple[Any, list[str]]:
    """The model a run's spec describes, with the weights of ``base`` (an
    :class:`~llmkit.runs.init_from.InitSource`; by default, for a spec with ``model.adapter``,
    ``train.init_from``'s) and the adapters attached, base frozen; ``load_base`` False
    builds the structure only, for weights loaded next. Returns the model and one line for
    each thing loaded or attached."""
    from llmkit.model import build_model
    from llmkit.model.adapters import attach_adapters
    from llmkit.runs.init_from import find_init_source, load_init_weights

    model = build_model(rs)
    adapter = rs.components.get(ADAPTER_SECTION)
    init_from = adapter_base(rs)
    lines: list[str] = []
    if load_base:
        if base is None and adapter is not None:
            base = find_init_source(init_from)
        if base is not None:
            t = rs.spec.train
            lines.append(
                load_init_weights(
                    model, base, vocab_size=rs.model.vocab_size, resize_vocab=t.init_resize_vocab
                )
            )
    if adapter is not None:
        # A resized vocabulary's new rows start random: with adapters they train, and are
        # saved with them (decided by the spec alone, so every load of the run agrees).
        also = vocabulary_tensors(model) if rs.spec.train.init_resize_vocab else []
        lines.append(attach_adapters(model, adapter, also=also).line())
    return model, lines


def vocabulary_tensors(model: Any) -> list[str]:
    """The token embedding and an untied head (a tied one is the embedding): what a
    vocabulary resize changes."""
    params = dict(model.named_parameters())  # a tied pair is listed once
    return [n for n in ("tok_emb.weight", "lm_head.weight") if n in params]


def load_run(path: str | Path, which: str = "final", device: str = "cpu") -> LoadedRun:
    """Rebuild the model of a run from its spec (a run with adapters: its base from
    ``train.init_from``, then the adapters) and load its weights and tokenizer."""
    run = open_run(path)
    weights = run.weights(which)
    rs = run.resolve()
    model, _ = build_run_model(rs)
    load_weights(model, weights)
    model.to(device).eval()
    return LoadedRun(rs, model, run.tokenizer(rs), weights, run.dir)
