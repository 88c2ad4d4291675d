"""Planning a parallel layout on paper: per-GPU memory, communication per step, a step time.

:func:`plan_memory` takes a model (built on the ``meta`` device, as ``llmkit info`` does, or
described by a :class:`ModelShape`) and a :class:`~llmkit.parallel.layout.Layout`, and
returns a :class:`ParallelPlan`: what each GPU holds and sends in one optimizer step.
Nothing is allocated and no torch is imported here: a built model is only read through its
``named_parameters()`` (shapes), ``config``, ``spec`` and ``flops_per_token()``.

Assumptions (each figure is an estimate, not a measurement):

- **Precision.** ``bf16`` is FSDP2's mixed precision as torchtitan and llmkit use it:
  fp32 master weights, fp32 gradients (reduced in fp32), AdamW's two fp32 states, bf16
  parameters in compute and bf16 activations. ``fp32`` keeps everything in fp32.
- **Tensor parallelism** (Megatron-LM with sequence parallelism, :mod:`llmkit.parallel.tensor`)
  splits every parameter of two or more dimensions (projections, the vocabulary of the
  embedding and the head) over ``tp``; one-dimensional ones (norm weights, biases) stay
  whole on every rank. With ``tp`` > ``n_kv_heads`` the copied key/value rows are not
  counted.
- **Pipeline parallelism** cuts the layers into ``pp × stages_per_rank`` stages as evenly as
  possible (the first stages take the extra layers); the token embedding is on the first
  stage, the final norm and the head on the last (a tied head counts a copy there). Rank
  ``r`` holds stages ``r, r + pp, …``. Every figure is that of one pipeline rank: memory
  that of the rank with the largest total, communication that of the rank sending most.
- **Data parallelism.** FSDP2 (ZeRO-3) shards parameters, gradients and optimizer state
  over ``dp_shard × cp``; ``dp_replicate`` (DDP, or HSDP's replicas) copies them. While a
  rank computes, it holds unsharded compute copies (``unsharded``): two blocks (the one
  computing and the one prefetched) and the embedding and head, whose root FSDP group stays
  gathered for the step; under pipeline parallelism (parameters not resharded after the
  forward, torchtitan's default there) and without FSDP (autocast keeps its bf16 casts for
  the backward) the whole rank's parameters. Gradients waiting for their reduce-scatter,
  allocator fragmentation, the CUDA context and NCCL buffers are not counted.
- **Activations** per layer and micro-batch: Korthikanti et al. 2022, ``s·b·h·(34 +
  5·a·s/h)`` bytes at 16 bits (the ``5·a·s/h`` scores term only for attention kernels that
  store the scores; ring attention never does), divided by ``tp`` (tensor with sequence
  parallelism: Megatron re-gathers the linears' inputs in backward; torch's DTensor keeps
  the gathered inputs, so llmkit stores up to ``4·s·b·h·(1 − 1/tp)`` bytes more per layer,
  not counted), with ``s`` the rank's ``seq_len / cp`` tokens. The last stage adds fp32
  logits and their gradient for one micro-batch (``b·s·V/tp·8`` bytes, as
  :func:`llmkit.model.accounting.training_memory`). With activation checkpointing each layer
  keeps its input (``2·s·b·h/tp``) and one layer's full activations exist during its
  recomputation.
- **Pipeline schedules.** ``batch_size`` sequences per data-parallel rank per step are cut
  into ``microbatches``; in flight on rank ``r``: GPipe all micro-batches, 1F1B
  ``min(pp − r, M)``, interleaved 1F1B ``min(2(pp − r − 1) + (v − 1)·pp + 1, M·v)`` stage
  chunks of ``1/v`` of the rank's layers (Megatron-LM's warm-up; on rank 0 the factor
  ``1 + (pp − 1)/(pp·v)`` of Korthikanti et al.). Without pipeline parallelism the batch is
  one micro-batch (no gradient accumulation).
- **Communication** is bytes each GPU *sends* per optimizer step (what it receives is the
  same), for ring collectives over ``n`` ranks: an all-gather or a reduce-scatter of a
  tensor of ``N`` bytes in all sends ``(n − 1)/n · N``, an all-reduce ``2(n − 1)/n · N``
  (the "bus bandwidth" convention of nccl-tests). Per dimension:

  - ``fsdp`` (``dp_shard × cp``): parameters all-gathered in compute precision in the
    forward and again in the backward (once per step under pipeline parallelism, where
    they are not resharded), gradients reduce-scattered in fp32.
  - ``ddp`` (``dp_replicate``): the (FSDP-sharded) fp32 gradients all-reduced once.
  - ``tp``: per layer and micro-batch, an all-gather of the sequence before the attention
    and before the ffn and a reduce-scatter of each one's output (4 in the forward), and
    their conjugates in the backward (4 more; a recomputed forward adds 4), each of
    ``(tp − 1)/tp · b·s·h`` elements; the embedding adds 3 (an all-reduce, the backward's
    all-gather), the head 2. The loss's scalar all-reduces and the norms' gradients are
    not counted.
  - ``cp``: per attention layer and micro-batch, ring attention sends the rank's key/value
    shard on ``cp − 1`` times in the forward and again in the backward (a recomputed
    forward: once more), and the fp32 key/value gradient accumulators ``cp`` times.
  - ``pp``: per micro-batch and stage boundary, the activation (sequence-parallel: ``1/tp``
    of ``b·s·h``) forward and its gradient backward.

- **Step time.** A lower bound: model FLOPs of the step (6N plus attention, PaLM's count,
  as ``llmkit info`` prints it) over ``world × peak × MFU``, with MFU
  :data:`MFU_ASSUMPTION` = 40 % (torchtitan reports 33–39 % for Llama 3.1 8B with FSDP on
  H100s). The pipeline bubble and exposed communication are assumed inside the MFU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llmkit.errors import LlmkitError
from llmkit.parallel.layout import Layout

__all__ = [
    "COMM_DIMS",
    "GPUS",
    "MFU_ASSUMPTION",
    "GpuSpec",
    "ModelShape",
    "ParallelPlan",
    "RankPlan",
    "gpu_spec",
    "model_shape",
    "plan_memory",
    "stage_layers",
]

#: Model FLOPs utilization assumed for the step-time bound.
MFU_ASSUMPTION = 0.40

#: The dimensions communication is counted for, in :class:`ParallelPlan.comm`.
COMM_DIMS = ("fsdp", "ddp", "tp", "cp", "pp")

#: Bytes per element of the compute copy of parameters and activations, by precision.
_COMPUTE_BYTES = {"bf16": 2, "fp32": 4}
#: fp32 master weights, fp32 gradients, AdamW's two fp32 states.
_MASTER, _GRAD, _OPTIM = 4, 4, 8


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's datasheet figures: memory (decimal bytes), dense bf16 tensor-core peak
    (FLOP/s), memory bandwidth and NVLink bandwidth (bytes/s, both directions together)."""

    name: str
    memory_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    nvlink_bandwidth: float


# From NVIDIA's datasheets: "NVIDIA H100 Tensor Core GPU" (H100 SXM: 80 GB HBM3, 3.35 TB/s,
# BF16 1,979 TFLOPS with sparsity = 989 dense, NVLink 900 GB/s); "NVIDIA H200 Tensor Core
# GPU" (H200 SXM: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity, NVLink 900 GB/s);
# "NVIDIA A100 Tensor Core GPU" (A100 80GB SXM: 2,039 GB/s, BF16 312 TFLOPS dense, NVLink
# 600 GB/s). The peaks agree with llmkit.hardware.GPU_PEAKS. The memory is the datasheet's
# decimal gigabytes: 80 GB = 74.5 GiB, some 5 GiB under what CUDA shows on an 80 GB H100,
# which leaves room for the CUDA context, NCCL and fragmentation the plan does not count.
GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec("H100", 80 * 10**9, 989e12, 3.35e12, 900e9),
    "H200": GpuSpec("H200", 141 * 10**9, 989e12, 4.8e12, 900e9),
    "A100": GpuSpec("A100", 80 * 10**9, 312e12, 2.039e12, 600e9),
}


def gpu_spec(name: str | GpuSpec) -> GpuSpec:
    """The :class:`GpuSpec` named ``name`` (case-insensitive: ``h100``, ``H100``)."""
    if isinstance(name, GpuSpec):
        return name
    spec = GPUS.get(name.strip().upper())
    if spec is None:
        raise LlmkitError(f"--gpus: unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return spec


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model. Parameter counts are elements; ``*_replicated``
    is the part tensor parallelism leaves whole (one-dimensional parameters)."""

    n_layers: int
    d_model: int
    n_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    layer_params: tuple[int, ...]
    layer_replicated: tuple[int, ...]
    embedding_params: int
    embedding_replicated: int = 0
    #: The final norm and the output head (without a tied head's weight, counted once in
    #: the embedding unless the pipeline puts the head on another rank).
    head_params: int = 0
    head_replicated: int = 0
    tied: bool = False
    #: Layers whose attention stores the T×T scores (Korthikanti's ``5as/h`` term).
    scores: tuple[bool, ...] = ()
    #: Model FLOPs per trained token at the planned context (0: no step-time bound).
    train_flops_per_token: float = 0.0

    @property
    def params(self) -> int:
        return sum(self.layer_params) + self.embedding_params + self.head_params


def model_shape(model: Any, seq_len: int) -> ModelShape:
    """The :class:`ModelShape` of a built :class:`~llmkit.model.Transformer` (``meta`` is
    enough): parameters by group from their names (``layers.N.*``; ``norm_f``, ``lm_head``:
    the head; the rest: the embedding)."""
    m = model.config
    n = m.n_layers
    layer = [0] * n
    layer_rep = [0] * n
    emb = emb_rep = head = head_rep = 0
    for name, p in model.named_parameters():
        numel, rep = int(p.numel()), int(p.numel()) if p.dim() < 2 else 0
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
            layer[int(parts[1])] += numel
            layer_rep[int(parts[1])] += rep
        elif parts[0] in ("norm_f", "lm_head"):
            head += numel
            head_rep += rep
        else:
            emb += numel
            emb_rep += rep
    scores = tuple(
        bool(plan.attention.record.capabilities.get("materializes_scores", False))
        for plan in model.spec.layers
    )
    return ModelShape(
        n_layers=n,
        d_model=m.d_model,
        n_heads=m.n_heads,
        kv_heads=m.kv_heads,
        head_dim=m.dim_head,
        vocab_size=m.vocab_size,
        layer_params=tuple(layer),
        layer_replicated=tuple(layer_rep),
        embedding_params=emb,
        embedding_replicated=emb_rep,
        head_params=head,
        head_replicated=head_rep,
        tied=bool(m.tie_embeddings),
        scores=scores,
        train_flops_per_token=float(model.flops_per_token(seq_len)["train"]),
    )


def stage_layers(n_layers: int, stages: int) -> list[list[int]]:
    """The layers of each pipeline stage: as even as possible, the first stages taking the
    extra layers."""
    base, extra = divmod(n_layers, stages)
    out, start = [], 0
    for i in range(stages):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


@dataclass(frozen=True)
class RankPlan:
    """One pipeline rank's share: its layers, parameters (elements, before FSDP sharding),
    memory (bytes) and communication (bytes sent per step, by dimension)."""

    rank: int
    layers: tuple[int, ...]
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    unsharded_bytes: int
    activation_bytes: int
    inflight: float
    comm: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return (
            self.param_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.unsharded_bytes
            + self.activation_bytes
        )

    @property
    def comm_total(self) -> int:
        return sum(self.comm.values())


@dataclass(frozen=True)
class ParallelPlan:
    """Per-GPU memory and communication of a layout (see the module's assumptions).

    The memory fields are those of :attr:`memory_rank` (the pipeline rank with the largest
    total), :attr:`comm` that of :attr:`comm_rank` (the one sending most)."""

    layout: Layout
    batch_size: int
    microbatch_size: int
    seq_len: int
    precision: str
    activation_checkpointing: bool
    memory_rank: RankPlan
    comm_rank: RankPlan
    ranks: tuple[RankPlan, ...]
    gpu: GpuSpec | None = None
    #: Model FLOPs of one optimizer step over all GPUs.
    flops_per_step: float = 0.0
    mfu: float = MFU_ASSUMPTION

    @property
    def param_bytes(self) -> int:
        return self.memory_rank.param_bytes

    @property
    def grad_bytes(self) -> int:
        return self.memory_rank.grad_bytes

    @property
    def optimizer_bytes(self) -> int:
        return self.memory_rank.optimizer_bytes

    @property
    def unsharded_bytes(self) -> int:
        return self.memory_rank.unsharded_bytes

    @property
    def activation_bytes(self) -> int:
        return self.memory_rank.activation_bytes

    @property
    def total_bytes(self) -> int:
        """The per-GPU peak estimate."""
        return self.memory_rank.total_bytes

    @property
    def comm(self) -> dict[str, int]:
        return dict(self.comm_rank.comm)

    @property
    def comm_total(self) -> int:
        return self.comm_rank.comm_total

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits the GPU's memory (None without a GPU)."""
        return None if self.gpu is None else self.total_bytes <= self.gpu.memory_bytes

    @property
    def tokens_per_step(self) -> int:
        return self.layout.dp * self.batch_size * self.seq_len

    @property
    def step_time(self) -> float | None:
        """Seconds per step at :attr:`mfu` of the GPUs' peak: a lower bound (None without a
        GPU or FLOPs)."""
        if self.gpu is None or not self.flops_per_step:
            return None
        return self.flops_per_step / (self.layout.world_size * self.gpu.peak_flops * self.mfu)

    @property
    def tokens_per_second_per_gpu(self) -> float | None:
        t = self.step_time
        return None if t is None else self.tokens_per_step / t / self.layout.world_size

    def as_dict(self) -> dict[str, Any]:
        """The plan's numbers, JSON-ready."""
        lay = self.layout
        return {
            "layout": {d: getattr(lay, d) for d in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}
            | {"schedule": lay.schedule, "microbatches": lay.microbatches, "world": lay.world_size},
            "batch_size": self.batch_size,
            "microbatch_size": self.microbatch_size,
            "seq_len": self.seq_len,
            "precision": self.precision,
            "activation_checkpointing": self.activation_checkpointing,
            "memory_rank": self.memory_rank.rank,
            "memory": {
                "params": self.param_bytes,
                "gradients": self.grad_bytes,
                "optimizer": self.optimizer_bytes,
                "unsharded": self.unsharded_bytes,
                "activations": self.activation_bytes,
                "total": self.total_bytes,
            },
            "comm_rank": self.comm_rank.rank,
            "comm": self.comm | {"total": self.comm_total},
            "gpu": None if self.gpu is None else self.gpu.name,
            "fits": self.fits,
            "flops_per_step": self.flops_per_step,
            "mfu": self.mfu,
            "step_time_s": self.step_time,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
        }


def _check(shape: ModelShape, layout: Layout, batch_size: int, seq_len: int) -> None:
    """One line for a layout whose arithmetic cannot be done."""
    tp = layout.tp
    if shape.n_heads % tp:
        raise LlmkitError(
            f"--parallel: tp = {tp} does not divide n_heads = {shape.n_heads} "
            "(tensor parallelism splits the heads)"
        )
    if shape.kv_heads % tp and tp % shape.kv_heads:
        raise LlmkitError(
            f"--parallel: tp = {tp} and n_kv_heads = {shape.kv_heads}: one must divide the other"
        )
    if shape.d_model % tp:
        raise LlmkitError(f"--parallel: tp = {tp} does not divide d_model = {shape.d_model}")
    if layout.stages > shape.n_layers:
        raise LlmkitError(
            f"--parallel: {layout.stages} pipeline stages but {shape.n_layers} layers; "
            "each stage needs a layer"
        )
    if layout.pp > 1 and batch_size % layout.microbatches:
        raise LlmkitError(
            f"--parallel: {layout.microbatches} pipeline micro-batches do not divide the "
            f"batch of {batch_size} sequences per data-parallel rank (--batch-size)"
        )
    if layout.cp > 1 and seq_len % (2 * layout.cp):
        raise LlmkitError(
            f"--parallel: cp = {layout.cp} needs a context that is a multiple of "
            f"2·cp = {2 * layout.cp}, not {seq_len} (--seq-len)"
        )


def _inflight(layout: Layout, rank: int) -> float:
    """Micro-batches whose activations rank ``rank`` holds at its peak, in units of all its
    layers (interleaved: stage chunks of 1/v of them)."""
    pp, m, v = layout.pp, layout.microbatches, layout.stages_per_rank
    if pp == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved_1f1b":
        return min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v) / v
    return float(min(pp - rank, m))


def plan_memory(
    model: Any,
    layout: Layout,
    *,
    batch_size: int,
    seq_len: int,
    precision: str = "bf16",
    activation_checkpointing: bool = False,
    gpu: GpuSpec | str | None = None,
) -> ParallelPlan:
    """Per-GPU memory and communication of training ``model`` (a :class:`ModelShape` or a
    built model) on ``layout``, ``batch_size`` sequences of ``seq_len`` tokens per
    data-parallel rank per step (cut into the pipeline's micro-batches when ``pp > 1``).
    A layout the arithmetic cannot split (``tp`` not dividing the heads, more stages than
    layers…) is a one-line :class:`~llmkit.errors.LlmkitError`."""
    if precision not in _COMPUTE_BYTES:
        raise LlmkitError(f"precision {precision!r}: plans know {', '.join(_COMPUTE_BYTES)}")
    shape = model if isinstance(model, ModelShape) else model_shape(model, seq_len)
    gpu = None if gpu is None else gpu_spec(gpu)
    _check(shape, layout, batch_size, seq_len)
    c = _COMPUTE_BYTES[precision]
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    n_shard, n_rep = layout.dp_shard * cp, layout.dp_replicate
    micro = batch_size // layout.microbatches if pp > 1 else batch_size
    n_micro = layout.microbatches if pp > 1 else 1
    s = seq_len // cp  # this rank's tokens of each sequence
    h = shape.d_model
    kv_local = max(shape.kv_heads // tp, 1)
    stages = stage_layers(shape.n_layers, layout.stages)
    last_stage = layout.stages - 1
    scores = shape.scores or (False,) * shape.n_layers

    def split(total: int, replicated: int) -> int:
        return math.ceil((total - replicated) / tp) + replicated

    def ring(n: int, nbytes: float) -> float:  # all-gather or reduce-scatter, bytes sent
        return (n - 1) / n * nbytes

    def layer_act(j: int) -> float:  # bytes, one layer, one micro-batch
        per = 34 + (5 * shape.n_heads * s / h if scores[j] and cp == 1 else 0)
        return s * micro * h * per / tp * c / 2

    ranks = []
    for r in range(pp):
        mine = list(range(r, layout.stages, pp))
        layers = [j for k in mine for j in stages[k]]
        first, last = 0 in mine, last_stage in mine
        layer_sizes = [split(shape.layer_params[j], shape.layer_replicated[j]) for j in layers]
        params = sum(layer_sizes)
        edges = 0
        if first:
            edges += split(shape.embedding_params, shape.embedding_replicated)
        if last:
            edges += split(shape.head_params, shape.head_replicated)
            if shape.tied and pp > 1:  # the head's copy of the tied embedding
                edges += math.ceil(shape.vocab_size * h / tp)
        params += edges
        sharded = math.ceil(params / n_shard)
        if n_shard > 1 and pp == 1:
            largest = sorted(layer_sizes, reverse=True)[:2]
            unsharded = (sum(largest) + edges) * c
        elif n_shard > 1 or c < _MASTER:
            unsharded = params * c
        else:
            unsharded = 0
        inflight = _inflight(layout, r)
        if activation_checkpointing:
            kept = 2 * s * micro * h / tp * c / 2
            act = inflight * len(layers) * kept + max((layer_act(j) for j in layers), default=0)
        else:
            act = inflight * sum(layer_act(j) for j in layers)
        if last:
            act += micro * s * math.ceil(shape.vocab_size / tp) * 8
        comm = dict.fromkeys(COMM_DIMS, 0.0)
        if n_shard > 1:
            gathers = 2 if pp == 1 else 1
            comm["fsdp"] = gathers * ring(n_shard, params * c) + ring(n_shard, params * _GRAD)
        if n_rep > 1:
            comm["ddp"] = 2 * ring(n_rep, sharded * _GRAD)
        if tp > 1:
            per_layer = 12 if activation_checkpointing else 8
            count = per_layer * len(layers) + (3 if first else 0) + (2 if last else 0)
            comm["tp"] = n_micro * count * ring(tp, micro * s * h * c)
        if cp > 1:
            kv = 2 * micro * s * kv_local * shape.head_dim
            passes = 3 if activation_checkpointing else 2
            per_layer = passes * (cp - 1) * kv * c + cp * kv * _GRAD
            comm["cp"] = n_micro * len(layers) * per_layer
        if pp > 1:
            sends = sum((k != last_stage) + (k != 0) for k in mine)
            comm["pp"] = n_micro * sends * micro * s * h / tp * c
        ranks.append(
            RankPlan(
                rank=r,
                layers=tuple(layers),
                params=params,
                param_bytes=sharded * _MASTER,
                grad_bytes=sharded * _GRAD,
                optimizer_bytes=sharded * _OPTIM,
                unsharded_bytes=int(unsharded),
                activation_bytes=round(act),
                inflight=inflight,
                comm={k: round(v) for k, v in comm.items()},
            )
        )
    flops = shape.train_flops_per_token * layout.dp * batch_size * seq_len
    return ParallelPlan(
        layout=layout,
        batch_size=batch_size,
        microbatch_size=micro,
        seq_len=seq_len,
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        memory_rank=max(ranks, key=lambda p: p.total_bytes),
        comm_rank=max(ranks, key=lambda p: p.comm_total),
        ranks=tuple(ranks),
        gpu=gpu,
        flops_per_step=flops,
    )
