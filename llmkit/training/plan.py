"""The run plan: what a training run is, settled once before it reads data.

A spec says what to train; a run also needs what the spec leaves to the run: the weights it
starts from (``train.init_from``, made absolute), the distillation teacher (made absolute),
the tokenizer it adopts (the init source's or the teacher's, its kind recorded), the
vocabulary (the tokenizer's size, unless the start weights keep a padded embedding) and the
objective (the spec's, wrapped for distillation). Every one of these edits of the resolved
spec happens here, in :class:`RunPlan`, and the spec is saved once, from the plan; the
trainer takes a plan and edits nothing.

:func:`plan_run` makes a plan from a spec file (a new run) or a run directory (a resume):
the spec is read once, ``--set`` edits and a ``max_steps`` cut applied to it (the warmup
scaled to fit, with a note), resolved once, and checked (the model builds; the directory may
hold the run; a resume may load its optimizer's state) before any data is read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmkit.errors import LlmkitError, SpecError
from llmkit.model.objective import Objective
from llmkit.runs import (
    ADAPTER_SECTION,
    SPEC_FILE,
    adapter_base,
    default_run_dir,
    open_run,
    save_spec,
)
from llmkit.runs import resume as run_resume
from llmkit.runs.checkpoints import Checkpoints
from llmkit.runs.init_from import InitSource, find_init_source
from llmkit.spec import ResolvedSpec, apply_override, fit_warmup, load_raw, resolve
from llmkit.spec.limits import recipe_problems


@dataclass
class RunPlan:
    """A run settled: its resolved spec as it will be saved, its directory, and where its
    weights and tokenizer come from. ``notes`` are what settling changed, for the log."""

    rs: ResolvedSpec
    run_dir: Path
    resume: bool = False
    #: Resumed with edits: the plan's spec replaces the run's once the checkpoint is restored.
    edited: bool = False
    #: The weights a new run starts from, or an adapted run's base (a resumed run without
    #: adapters restores every weight from its checkpoint: None).
    init: InitSource | None = None
    #: A tokenizer the run takes from elsewhere (the init source's, else the teacher's).
    tokenizer_source: Path | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def settle(
        cls, rs: ResolvedSpec, run_dir: str | Path, *, resume: bool = False, edited: bool = False
    ) -> RunPlan:
        """The plan for a resolved spec: the init source, the teacher and the tokenizer to
        adopt are found (one-line errors when they name nothing usable) and written into the
        spec."""
        plan = cls(rs, Path(run_dir), resume=resume, edited=edited)
        plan._settle_init()
        plan._settle_tokenizer()
        return plan

    @property
    def train(self) -> Any:
        return self.rs.spec.train

    @property
    def block_size(self) -> int:
        return self.rs.spec.data.block_size or self.rs.model.max_seq_len

    def _settle_init(self) -> None:
        init_from = adapter_base(self.rs)
        if init_from is None or (self.resume and ADAPTER_SECTION not in self.rs.components):
            return
        self.init = find_init_source(init_from)
        self.rs = self.rs.with_settings({"train.init_from": str(self.init.path)})

    def _settle_tokenizer(self) -> None:
        """A new run's tokenizer comes from the init source, else from the distillation
        teacher, unless the spec names one; its kind is recorded in the spec."""
        if self.resume:
            return
        from llmkit.training.distill import teacher_tokenizer

        distill = self.train.distill
        teacher_tok = None
        if distill is not None:
            teacher_tok = teacher_tokenizer(distill)  # a bad teacher path fails here, early
            teacher = str(Path(distill.teacher).expanduser().absolute())
            self.rs = self.rs.with_settings(
                {"train.distill": distill.model_copy(update={"teacher": teacher})}
            )
        if self.rs.spec.tokenizer.path is not None:
            return
        source = self.init.tokenizer if self.init is not None else teacher_tok
        if source is None:
            return
        from llmkit.data.tokenizer import Tokenizer

        self.tokenizer_source = source
        kind = Tokenizer.load(source).kind
        if kind != self.rs.spec.tokenizer.kind and kind in ("bpe", "char"):
            self.rs = self.rs.with_settings({"tokenizer.kind": kind})

    def settle_vocabulary(self, tokenizer: Any) -> str | None:
        """The model's vocabulary is the tokenizer's size, except where the start weights
        keep a padded embedding (an imported checkpoint's vocabulary is often rounded up past
        its tokenizer's) or a resumed run's saved spec settled it. Returns the log line of a
        change."""
        t = self.train
        padded = self.resume or (
            self.init is not None
            and not t.init_resize_vocab
            and tokenizer.vocab_size < self.rs.model.vocab_size
            and _embedding_rows(self.init.weights) == self.rs.model.vocab_size
        )
        if tokenizer.vocab_size == self.rs.model.vocab_size or padded:
            return None
        line = f"vocab_size {self.rs.model.vocab_size} -> {tokenizer.vocab_size} (the tokenizer's)"
        self.rs = self.rs.with_vocab_size(tokenizer.vocab_size)
        self.rs.source = str(self.run_dir / SPEC_FILE)
        return line

    def objective(
        self, tokenizer: Any, device: torch.device, log: Callable[[str], None]
    ) -> Objective:
        """What training minimizes: the spec's objective, wrapped to learn from the teacher
        when ``train.distill`` names one (checked against the run's tokenizer and blocks)."""
        objective = Objective.from_spec(self.rs, document_eos=self.document_eos(tokenizer))
        distill = self.train.distill
        if distill is None:
            return objective
        from llmkit.training.distill import Distillation, load_teacher

        teacher = load_teacher(distill, tokenizer, device, self.block_size)
        log(f"distill: teacher {distill.teacher} (T {distill.temperature}, alpha {distill.alpha})")
        return Distillation(
            objective, teacher, temperature=distill.temperature, alpha=distill.alpha
        )

    def document_eos(self, tokenizer: Any) -> int | None:
        """The EOS that separates packed documents under ``data.document_mask`` (None
        without it); a tokenizer without one cannot mark documents."""
        if not self.rs.spec.data.document_mask:
            return None
        eos = getattr(tokenizer, "eos_id", None)
        if eos is None:
            raise LlmkitError(
                "data.document_mask: the tokenizer has no end-of-text token to separate "
                "documents (tokenizer.special_tokens' first entry is that token)"
            )
        return int(eos)

    def save(self) -> None:
        """Write the plan's spec into the run (``spec.yaml``, ``resolved.json``)."""
        save_spec(self.rs, self.run_dir)


def plan_run(
    spec_path: str | Path | None = None,
    *,
    run_dir: str | Path | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    max_steps: int | None = None,
) -> RunPlan:
    """The plan of a new run from ``spec_path``, or of resuming the run in ``run_dir``, with
    ``overrides`` (``--set``) and ``max_steps`` (which scales a warmup longer than it down,
    noted in the plan) applied to the spec as read, resolved once."""
    sets = list(overrides or [])
    if resume:
        if run_dir is None:
            raise LlmkitError("--resume needs the run directory")
        run = open_run(run_dir)
        if run.checkpoint is not None:
            raise LlmkitError(f"{run_dir} is a checkpoint; resume its run: --resume {run.dir}")
        if not Checkpoints(run.dir).newest_first():  # before any data is read
            raise run_resume.nothing_to_resume(run.dir)
        notes = _cut_to(run.raw, sets, max_steps)
        data = _edited(run.raw, sets)
        rs = resolve(data, source=str(run.spec_file))
        if sets:  # against the saved spec as written, not resolved again
            check_same_optimizer(run.raw, rs)
        plan = RunPlan.settle(rs, run.dir, resume=True, edited=bool(sets))
    else:
        if spec_path is None:
            raise LlmkitError("a spec file is required (or --resume RUN_DIR)")
        raw = load_raw(spec_path)
        notes = _cut_to(raw, sets, max_steps)
        rs = resolve(_edited(raw, sets), source=str(spec_path))
        from llmkit.model import build_problems

        # What training would refuse, and a model that cannot be built: before data is read.
        found = recipe_problems(rs) or build_problems(rs)
        if found:
            raise SpecError(found, str(spec_path))
        rd = Path(run_dir) if run_dir else default_run_dir(rs)
        run_resume.check_new_run_dir(rd)
        plan = RunPlan.settle(rs, rd)
    plan.notes[:0] = notes
    return plan


def _edited(raw: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    import copy

    data = copy.deepcopy(raw)
    for assignment in sets:
        apply_override(data, assignment)
    return data


def _cut_to(raw: dict[str, Any], sets: list[str], max_steps: int | None) -> list[str]:
    """Add ``max_steps`` to ``sets``, after the edit that scales the schedule's warmup down
    to fit it (a quick ``--max-steps 10`` try always runs); the note that says so. A spec
    whose own warmup exceeds its own ``train.max_steps`` is left for validation to refuse."""
    if max_steps is None:
        return []
    notes = []
    try:
        fitted = fit_warmup(_edited(raw, sets), max_steps)
    except LlmkitError:  # a spec that does not read: resolution reports it
        fitted = None
    if fitted is not None:
        assignment, note = fitted
        sets.append(assignment)
        notes.append(note)
    sets.append(f"train.max_steps={max_steps}")
    return notes


def check_same_optimizer(saved: dict[str, Any], edited: ResolvedSpec) -> None:
    """Edits on resume may change hyperparameters, not the optimizer whose state it loads.
    ``saved`` is the run's spec as written (its component names filled in), so the saved
    recipe is not resolved a second time."""
    table = saved.get("optimizer")
    before = table.get("name") if isinstance(table, dict) else None
    if before is None:  # a hand-written spec.yaml: the kind's default
        from llmkit.registry import get_registry

        before = get_registry().kinds["optimizer"].default
    after = edited.optimizer.record.name
    if before != after:
        raise LlmkitError(
            f"the run was trained with optimizer {before!r}; resuming it with {after!r} cannot "
            "load its state (start a new run, or keep the optimizer)"
        )


def log_notes(plan: RunPlan) -> None:
    """The plan's notes, once for a job (rank 0 under torchrun)."""
    if os.environ.get("RANK", "0") in ("", "0"):
        for note in plan.notes:
            logging.getLogger("llmkit").info(note)


def _embedding_rows(weights: Path) -> int | None:
    """Rows of the token embedding in a weights file (its header only), if it has one."""
    from llmkit.runs.checkpoints import weight_shapes

    try:
        shapes = weight_shapes(weights)
    except (OSError, ValueError, LlmkitError):
        return None
    # A tied pair is stored once, under lm_head.weight (safetensors keeps one name).
    shape = shapes.get("tok_emb.weight") or shapes.get("lm_head.weight")
    return shape[0] if shape else None
