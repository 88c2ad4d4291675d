"""The device-mesh layout of a job: ``dp_replicate × dp_shard × cp × tp × pp``.

``train.parallel`` is a shorthand (``ddp``, ``fsdp``, ``auto``, ``none``) or a table
(:class:`llmkit.spec.models.ParallelSpec`); :func:`resolve_layout` turns either into a
:class:`Layout` for a world size, and :func:`layout_problems` says, from the spec alone (no
model is allocated), what this layout cannot train: a product that is not the world size,
tensor parallelism not dividing the heads, more pipeline stages than layers, a sequence
context parallelism cannot split. Torch-free: ``llmkit validate`` and ``llmkit info`` use it.

Mesh dimensions, outermost first, are those of torchtitan: ``pp``, ``dp_replicate``,
``dp_shard``, ``cp``, ``tp`` (tensor parallelism innermost, on the fastest links).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmkit.errors import LlmkitError

__all__ = ["MESH_DIMS", "Layout", "layout_problems", "parse_layout", "resolve_layout"]

#: The mesh's dimensions, outermost first.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

#: What ``--parallel dp=32,tp=8`` may name, and the field each name sets.
_SHORT_NAMES = {
    "dp": "dp_shard",
    "fsdp": "dp_shard",
    "dp_shard": "dp_shard",
    "ddp": "dp_replicate",
    "dp_replicate": "dp_replicate",
    "tp": "tp",
    "pp": "pp",
    "cp": "cp",
}


@dataclass(frozen=True)
class Layout:
    """Degrees of every mesh dimension (each ≥ 1) and the pipeline's schedule."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    stages_per_rank: int = 1
    #: How the layout was asked for: a shorthand ("ddp", "fsdp", "none") or "mesh".
    form: str = "mesh"

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different rows."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)

    @property
    def stages(self) -> int:
        """Pipeline stages in all (``pp × stages_per_rank``)."""
        return self.pp * self.stages_per_rank

    @property
    def mode(self) -> str:
        """``single`` (one process), ``ddp``, ``fsdp`` (pure data parallelism, the two
        historic strategies) or ``mesh`` (anything composed)."""
        if self.world_size == 1:
            return "single"
        if self.tp == self.pp == self.cp == 1:
            if self.dp_shard == 1 and self.form != "mesh":
                return "ddp"
            if self.dp_replicate == 1 and self.form != "mesh":
                return "fsdp"
        return "mesh"

    def describe(self) -> str:
        parts = [f"{d}={getattr(self, d)}" for d in MESH_DIMS if getattr(self, d) > 1]
        text = " × ".join(parts) if parts else "one process"
        if self.pp > 1:
            text += (
                f" (pipeline {self.schedule}, {self.microbatches} micro-batches, "
                f"{self.stages} stages)"
            )
        return text


def _fill(values: dict[str, int], world: int) -> dict[str, int]:
    """Replace a -1 degree by what the others leave of ``world``."""
    fixed = 1
    for key in MESH_DIMS:
        if values[key] != -1:
            fixed *= values[key]
    for key in ("dp_replicate", "dp_shard"):
        if values[key] == -1:
            if world % fixed:
                raise LlmkitError(
                    f"train.parallel: {key} = -1 fills the world size, but {world} processes "
                    f"are not a multiple of the other degrees' product {fixed}"
                )
            values[key] = world // fixed
    return values


def resolve_layout(parallel: Any, world: int) -> Layout:
    """The :class:`Layout` of ``train.parallel`` on ``world`` processes (the product of its
    degrees must equal ``world``: one line when it does not)."""
    if isinstance(parallel, str):
        if world <= 1:
            return Layout(form=parallel if parallel in ("ddp", "fsdp") else "none")
        if parallel == "none":
            raise LlmkitError(
                f"train.parallel is 'none' but the job was launched on {world} processes; "
                "set train.parallel to 'ddp' or 'fsdp' (or 'auto')"
            )
        if parallel == "fsdp":
            return Layout(dp_shard=world, form="fsdp")
        return Layout(dp_replicate=world, form="ddp")  # ddp, auto
    values = {d: getattr(parallel, d) for d in MESH_DIMS}
    values = _fill(values, world)
    interleaved = parallel.schedule == "interleaved_1f1b"
    stages_per_rank = parallel.stages_per_rank or (2 if interleaved else 1)
    pp = values["pp"]
    micro = parallel.microbatches or (pp * stages_per_rank if interleaved else pp)
    layout = Layout(
        **values,
        schedule=parallel.schedule,
        microbatches=micro if pp > 1 else 1,
        stages_per_rank=stages_per_rank if pp > 1 else 1,
    )
    if layout.world_size != world:
        raise LlmkitError(
            f"train.parallel: {layout.describe()} is {layout.world_size} processes, but the "
            f"job was launched on {world}; the degrees' product must be the world size"
        )
    return layout


def parse_layout(text: str, schedule: str = "1f1b") -> Layout:
    """``dp=32,tp=8,pp=4`` (``dp``/``fsdp`` = dp_shard, ``ddp`` = dp_replicate) as a
    :class:`Layout`; unnamed degrees are 1."""
    values = {d: 1 for d in MESH_DIMS}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, raw = part.partition("=")
        key = _SHORT_NAMES.get(name.strip())
        if not sep or key is None:
            names = ", ".join(sorted(_SHORT_NAMES))
            raise LlmkitError(f"--parallel: {part!r} is not NAME=N with NAME one of {names}")
        try:
            values[key] = int(raw)
        except ValueError:
            raise LlmkitError(f"--parallel: {part!r}: {raw!r} is not an integer") from None
        if values[key] < 1:
            raise LlmkitError(f"--parallel: {part!r}: degrees are ≥ 1")
    pp = values["pp"]
    spr = 2 if schedule == "interleaved_1f1b" and pp > 1 else 1
    return Layout(**values, schedule=schedule, microbatches=max(pp * spr, 1), stages_per_rank=spr)


def _pipeline_problems(spec: Any, layout: Layout) -> list[str]:
    """What pipeline parallelism does not train yet, one line each."""
    m, t = spec.model, spec.train
    extra = getattr(t, "model_extra", None) or {}
    refused = [
        (
            m.tie_embeddings,
            "model.tie_embeddings (the embedding and the head sit on the first "
            "and the last stage; set it to false)",
        ),
        (
            getattr(t, "loss", None) is not None or "loss" in extra,
            "a train.loss component (the last stage trains the cross-entropy)",
        ),
        (getattr(t, "distill", None) is not None, "train.distill"),
        (spec.data.document_mask, "data.document_mask"),
    ]
    return [
        f"train.parallel.pp = {layout.pp} cannot be combined with {what}"
        for bad, what in refused
        if bad
    ]


def check_layout(rs: Any, layout: Layout) -> None:
    """One line (:class:`LlmkitError`) when the resolved spec ``rs`` cannot train on
    ``layout`` (:func:`layout_problems` with its layers' attention kernels and positional
    schemes), before anything is allocated."""
    kernels = [plan.attention for plan in rs.layers]
    positions = [plan.position for plan in rs.layers]
    problems = layout_problems(rs.spec, layout, kernels, positions)
    if problems:
        more = f" (and {len(problems) - 1} more)" if problems[1:] else ""
        raise LlmkitError(problems[0] + more)


def layout_problems(
    spec: Any, layout: Layout, attention_kernels: list[Any] = (), positions: list[Any] = ()
) -> list[str]:
    """What stops ``spec`` (a :class:`llmkit.spec.Spec`) from training on ``layout``, one
    line each, found from the spec alone. ``attention_kernels`` and ``positions`` are the
    layers' resolved attention and positional components (to check context parallelism's
    support), when known."""
    m, t = spec.model, spec.train
    out: list[str] = []
    heads, kv = m.n_heads, m.kv_heads
    n_layers = m.n_layers
    if layout.tp > 1:
        if heads % layout.tp:
            out.append(
                f"train.parallel.tp = {layout.tp} does not divide model.n_heads = {heads} "
                "(tensor parallelism splits the heads)"
            )
        elif kv % layout.tp and layout.tp % kv:
            out.append(
                f"train.parallel.tp = {layout.tp} neither divides nor is a multiple of "
                f"model.n_kv_heads = {kv} (each rank holds whole key/value heads, or copies "
                "of one)"
            )
        if m.d_model % layout.tp:
            out.append(
                f"train.parallel.tp = {layout.tp} does not divide model.d_model = {m.d_model} "
                "(sequence parallelism splits activations)"
            )
    if layout.pp > 1:
        if layout.stages > n_layers:
            out.append(
                f"train.parallel: {layout.stages} pipeline stages (pp = {layout.pp} × "
                f"{layout.stages_per_rank} per rank) but model.n_layers = {n_layers}; each "
                "stage needs a layer"
            )
        if layout.schedule == "interleaved_1f1b" and layout.stages_per_rank < 2:
            out.append("train.parallel: interleaved_1f1b needs stages_per_rank ≥ 2")
        if layout.schedule != "interleaved_1f1b" and layout.stages_per_rank != 1:
            out.append(
                f"train.parallel: {layout.schedule} holds one stage per rank; "
                "stages_per_rank > 1 is for interleaved_1f1b"
            )
        if t.batch_size % layout.microbatches:
            out.append(
                f"train.parallel.microbatches = {layout.microbatches} does not divide "
                f"train.batch_size = {t.batch_size}"
            )
        elif layout.schedule != "gpipe" and layout.microbatches < layout.pp:
            out.append(
                f"train.parallel: {layout.schedule} needs microbatches ≥ pp "
                f"({layout.microbatches} < {layout.pp})"
            )
        if layout.schedule == "interleaved_1f1b" and layout.microbatches % layout.pp:
            out.append(
                f"train.parallel: interleaved_1f1b needs microbatches ({layout.microbatches}) "
                f"to be a multiple of pp ({layout.pp})"
            )
    if layout.pp > 1:
        out += _pipeline_problems(spec, layout)
    if layout.cp > 1:
        block = spec.data.block_size or m.max_seq_len
        if block % (2 * layout.cp):
            out.append(
                f"train.parallel.cp = {layout.cp}: data.block_size = {block} must be a "
                f"multiple of 2·cp = {2 * layout.cp} (each rank takes two balanced chunks)"
            )
        if spec.data.document_mask:
            out.append("train.parallel.cp > 1 cannot be combined with data.document_mask")
        for j, kernel in enumerate(attention_kernels):
            if not kernel.record.capabilities.get("context_parallel", False):
                out.append(
                    f"attention {kernel.name!r} (layer {j}) does not support context "
                    "parallelism (train.parallel.cp > 1): its registry entry does not "
                    "declare the context_parallel capability"
                )
                break
            if getattr(kernel.options, "dropout", 0.0) > 0:
                out.append(
                    f"attention {kernel.name!r} (layer {j}): attention dropout cannot be "
                    "combined with context parallelism (train.parallel.cp > 1)"
                )
                break
        for j, position in enumerate(positions):
            if "score_bias" in position.record.capabilities.get("acts_on", []):
                out.append(
                    f"position {position.name!r} (layer {j}) biases the attention scores, "
                    "which context parallelism (train.parallel.cp > 1) does not carry; "
                    "use rope, learned, sinusoidal or none"
                )
                break
    return out
