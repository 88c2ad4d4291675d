"""The outer structure of a spec file (pass one), as pydantic models.

Component tables (``model.attention``, ``optimizer``, ``data.source``, ``train.loss``…) are
not fields here: each kind declares its section in the registry, and
:mod:`llmkit.spec.sections` adds one field per declared section to these models.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Upper bounds on sizes (see docs/training.md, "What a spec may not do"): far above any model
#: llmkit trains, low enough that a typo fails in validation instead of in an allocation.
MAX_VOCAB = 2**24
MAX_WIDTH = 2**16  # d_model
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 2**14
MAX_SEQ_LEN = 2**20
MAX_BATCH = 2**20
#: The devices training can use: auto, cpu, cuda, cuda:N, mps.
DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


class Strict(BaseModel):
    """A spec table: unknown keys and non-finite floats (inf, nan) are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ComponentRef(BaseModel):
    """``{ name = "...", <options> }``: options are checked in pass two."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(description="Registered component name (see `llmkit list KIND`).")

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


LayerSelector = list[int] | str


def is_layer_selector(value: Any) -> bool:
    """Whether ``value`` has a selector's form: a list of integers, or a string."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    )


class LayerOverride(Strict):
    """Replace components on selected layers.

    ``layers``: a list of indices (negative counts from the end), or a slice string
    ``"start:stop:step"`` such as ``"2:"`` (layer 2 on) or ``"::2"`` (every other layer).
    """

    layers: LayerSelector = Field(description="Indices [0, 3] or a slice 'start:stop:step'.")

    @field_validator("layers", mode="before")
    @classmethod
    def _selector(cls, value: Any) -> Any:
        if not is_layer_selector(value):
            raise ValueError(
                "expected a list of layer indices such as [0, 3] or a slice string such as "
                f"'2:' or '::2', not {value!r}"[:200]
            )
        return value


class ModelSpec(Strict):
    """The architecture."""

    vocab_size: int = Field(
        50304, gt=0, le=MAX_VOCAB, description="Vocabulary size (embedding rows)."
    )
    d_model: int = Field(gt=0, le=MAX_WIDTH, description="Residual-stream width.")
    n_layers: int = Field(gt=0, le=MAX_LAYERS, description="Number of Transformer blocks.")
    n_heads: int = Field(gt=0, le=MAX_HEADS, description="Query heads.")
    n_kv_heads: int | None = Field(
        None, gt=0, le=MAX_HEADS, description="Key/value heads (GQA; 1 = MQA); default n_heads."
    )
    head_dim: int | None = Field(
        None, gt=0, le=MAX_HEAD_DIM, description="Per-head size; default d_model/n_heads."
    )
    max_seq_len: int = Field(
        1024, gt=0, le=MAX_SEQ_LEN, description="Longest context the model is built for."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Embedding and residual dropout.")
    bias: bool = Field(True, description="Biases in linear layers (and norms that take one).")
    tie_embeddings: bool = Field(True, description="Share input embedding and output head.")
    norm_placement: Literal["pre", "post"] = Field(
        "pre", description="Shorthand for model.block = pre_norm / post_norm."
    )
    final_norm: bool = Field(True, description="A norm before the output head.")
    qkv_bias: bool | None = Field(
        None,
        description="Biases on the attention's q/k/v projection; unset follows bias "
        "(Qwen2: true while the output projection has none).",
    )
    attn_out_bias: bool | None = Field(
        None, description="A bias on the attention's output projection; unset follows bias."
    )
    attn_scale: float | None = Field(
        None,
        gt=0,
        description="Softmax scale of the attention scores; unset 1/sqrt(head_dim) "
        "(Gemma 2: query_pre_attn_scalar^-0.5).",
    )
    embedding_scale: float | Literal["sqrt_d_model"] = Field(
        1.0,
        description="Multiply token embeddings by this before the first block; sqrt_d_model "
        "is Gemma's √d_model.",
    )
    head_bias: bool = Field(False, description="A bias on the output head (Phi).")
    logit_softcap: float | None = Field(
        None,
        gt=0,
        description="Soft-cap the output logits to (−c, c) as c·tanh(logits/c) (Gemma 2).",
    )
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init.")
    scaled_residual_init: bool = Field(
        True, description="Scale residual output projections by 1/sqrt(2·n_layers) (GPT-2)."
    )
    overrides: list[LayerOverride] = Field(
        default_factory=list, description="Per-layer component replacements."
    )

    @model_validator(mode="after")
    def _heads(self) -> ModelSpec:
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({kv})")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                "unless head_dim is given"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


class TokenizerSpec(Strict):
    """How text becomes token ids."""

    kind: Literal["bpe", "char"] = Field(
        "bpe", description="Byte-level BPE trained on the corpus, or one token per character."
    )
    path: str | None = Field(
        None, description="A pre-trained tokenizer.json to use instead of training one."
    )
    vocab_size: int | None = Field(
        None, gt=0, le=MAX_VOCAB, description="BPE vocabulary size; default model.vocab_size."
    )
    special_tokens: list[str] = Field(
        default_factory=lambda: ["<|endoftext|>"],
        description="Special tokens; the first one separates documents.",
    )
    min_frequency: int = Field(2, ge=1, description="BPE: minimum pair frequency to merge.")
    train_bytes: int | None = Field(
        20_000_000, gt=0, description="Train the tokenizer on at most this much text."
    )

    @field_validator("special_tokens")
    @classmethod
    def _distinct_tokens(cls, tokens: list[str]) -> list[str]:
        if any(not t for t in tokens):
            raise ValueError("a special token cannot be empty")
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"special tokens must be distinct, got {tokens}")
        return tokens


#: A mixture part's name: it names metrics (``val_loss/<name>``) and cached files.
MIXTURE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_MIXTURE = 64


class MixtureEntry(Strict):
    """One source of a mixture and its share of the training tokens."""

    name: str | None = Field(
        None,
        description="Names the source in metrics (val_loss/<name>) and logs; default the "
        "source's component name.",
    )
    source: ComponentRef = Field(description="A corpus source (see `llmkit list dataset`).")
    weight: float = Field(
        gt=0, le=1e9, description="Relative share of training tokens (normalised to sum 1)."
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str | None) -> str | None:
        if name is not None and not MIXTURE_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r}: a mixture name is 1-64 letters, digits, '_', '.' or '-', "
                "starting with a letter or digit"
            )
        return name

    @property
    def label(self) -> str:
        return self.name or self.source.name


class DataSpec(Strict):
    """Where the corpus comes from and how it is cut into blocks."""

    mixture: list[MixtureEntry] = Field(
        default_factory=list,
        max_length=MAX_MIXTURE,
        description="Several sources, each tokenized and cached on its own, sampled by weight "
        "(data.source, written or inherited, is then unused); validation reports each one "
        "(val_loss/<name>) and the weighted mix. Weights may change when a run is resumed "
        "(a curriculum).",
    )
    streaming: bool = Field(
        False,
        description="Read a file source (jsonl, parquet, text) as a stream, tokenized on the fly "
        "in DataLoader workers, instead of tokenizing it into a token file first; "
        "validation is val_paths or the held-out tail (val_fraction, at most 8 MiB).",
    )
    stream_workers: int = Field(
        2, ge=0, le=256, description="DataLoader worker processes of a streamed source."
    )
    document_mask: bool = Field(
        False,
        description="In packed rows, attention does not cross document boundaries (a token "
        "after the tokenizer's EOS starts a new document) and positions restart per "
        "document, as Llama 3 trains.",
    )

    block_size: int | None = Field(
        None, gt=0, description="Tokens per training sequence; default model.max_seq_len."
    )
    cache_dir: str | None = Field(
        None, description="Where tokenized data is cached; default <run>/data."
    )
    shared_cache: bool = Field(
        True,
        description="Keep the trained tokenizer and the token files in the shared cache "
        "($LLMKIT_CACHE_DIR, else ~/.cache/llmkit), and take them from there when an earlier "
        "run made them from the same files (their content up to 64 MiB, else path, size and "
        "modification time), source options, "
        "seed and tokenizer spec: the corpus is then not loaded at all.",
    )
    num_proc: int = Field(1, ge=1, description="Processes for tokenization (datasets.map).")
    seed: int | None = Field(
        None,
        ge=0,
        lt=2**63,
        description="Seeds the train/validation split, the files picked and the tokenizer's "
        "sample; default train.seed. Fix it to compare seeds on one validation set.",
    )
    sampling: Literal["packed", "random", "padded"] = Field(
        "packed",
        description="packed: every block once per epoch (grid shifted in later epochs); "
        "random: windows starting anywhere, drawn independently (as nanoGPT); padded: one "
        "document (conversation) per row, cut to the block and padded with ignored targets.",
    )

    @field_validator("mixture")
    @classmethod
    def _distinct_sources(cls, mixture: list[MixtureEntry]) -> list[MixtureEntry]:
        names: dict[str, int] = {}
        sources: dict[str, int] = {}
        for i, entry in enumerate(mixture):
            key = repr(sorted({"name": entry.source.name, **entry.source.options}.items()))
            if key in sources:
                raise ValueError(
                    f"entries {sources[key]} and {i} name one source twice "
                    f"({entry.source.name!r} with the same options)"
                )
            sources[key] = i
            if entry.label in names:
                raise ValueError(
                    f"entries {names[entry.label]} and {i} are both called {entry.label!r}: "
                    "give each a distinct name"
                )
            names[entry.label] = i
        return mixture


class DistillSpec(Strict):
    """Knowledge distillation: the loss is α·T²·KL(softmax(teacher/T) ‖ softmax(student/T))
    plus (1 − α) times the hard-label objective (Hinton et al. 2015)."""

    teacher: str = Field(
        min_length=1, description="The teacher: a run directory or a checkpoint inside one."
    )
    weights: Literal["final", "best", "latest"] = Field(
        "final", description="Which of the teacher run's weights (a checkpoint names its own)."
    )
    temperature: float = Field(
        2.5, gt=0, le=100, allow_inf_nan=False, description="Softens both distributions."
    )
    alpha: float = Field(
        0.5, ge=0, le=1, allow_inf_nan=False, description="Weight of the distillation term."
    )


class ParallelSpec(Strict):
    """``[train.parallel]``: the device mesh ``dp_replicate × dp_shard × cp × tp × pp`` (as
    torchtitan composes it). Their product is the job's world size; one of ``dp_replicate``
    and ``dp_shard`` may be -1: whatever the others leave (:mod:`llmkit.parallel.layout`)."""

    dp_replicate: int = Field(
        1, ge=-1, le=1_000_000, description="Data-parallel replicas (DDP-like; -1 = fill)."
    )
    dp_shard: int = Field(
        -1, ge=-1, le=1_000_000, description="Data-parallel shards (FSDP2; -1 = fill)."
    )
    cp: int = Field(
        1, ge=1, le=65_536, description="Context parallelism: ranks splitting each sequence."
    )
    tp: int = Field(
        1, ge=1, le=65_536, description="Tensor parallelism: ranks splitting each layer."
    )
    pp: int = Field(1, ge=1, le=65_536, description="Pipeline parallelism: pipeline stages.")
    schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = Field(
        "1f1b", description="The pipeline schedule (pp > 1)."
    )
    microbatches: int | None = Field(
        None,
        gt=0,
        le=1_000_000,
        description="Pipeline micro-batches per batch (pp > 1); default pp (interleaved: 2·pp); "
        "must divide train.batch_size.",
    )
    stages_per_rank: int | None = Field(
        None,
        gt=0,
        le=64,
        description="Pipeline stages each rank holds: 1, or ≥ 2 for interleaved_1f1b "
        "(default 2 there).",
    )

    @model_validator(mode="after")
    def _fill(self) -> ParallelSpec:
        if self.dp_replicate == 0 or self.dp_shard == 0:
            raise ValueError("dp_replicate and dp_shard are ≥ 1, or -1 to fill")
        if self.dp_replicate == -1 and self.dp_shard == -1:
            raise ValueError("only one of dp_replicate and dp_shard can be -1 (fill)")
        return self


class TrainSpec(Strict):
    """The training recipe besides optimizer and schedule."""

    batch_size: int = Field(
        16, gt=0, le=MAX_BATCH, description="Sequences per micro-batch on each process (rank)."
    )
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    max_steps: int = Field(1000, gt=0, description="Optimizer steps (the schedule's length).")
    max_time: float | None = Field(None, gt=0, description="Stop after this many seconds.")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global grad norm; none=off.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto = bf16 autocast where the hardware has it, else fp32."
    )
    device: str = Field("auto", description="auto (cuda, mps, cpu), cpu, cuda, cuda:N or mps.")
    compile: bool = Field(False, description="Wrap the model in torch.compile.")
    reuse_freed_memory: bool = Field(
        True,
        description="On a Linux CPU, let malloc keep freed blocks of up to 32 MiB for reuse "
        "instead of unmapping them: no page faults on each step's activations (about 15 % of "
        "a bf16 step); the process keeps its peak memory.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each block's activations in backward."
    )
    seed: int = Field(1337, ge=0, lt=2**63, description="Seeds init, data order and dropout.")
    eval_interval: int = Field(250, gt=0, description="Evaluate every N steps (and at the end).")
    eval_batches: int = Field(20, gt=0, description="Validation batches per evaluation.")
    log_interval: int = Field(10, gt=0, description="Write a metrics line every N steps.")
    plot: bool = Field(
        True,
        description="Draw the loss curve (loss.png) at checkpoints and at the end; false "
        "saves matplotlib's import (about a second) on short runs.",
    )
    checkpoint_interval: int | None = Field(
        None, gt=0, description="Checkpoint every N steps; default eval_interval."
    )
    checkpoint_steps: list[Annotated[int, Field(gt=0)]] = Field(
        default_factory=list,
        max_length=10_000,
        description="Extra steps to save a checkpoint at, kept however many checkpoints are "
        "pruned (each > 0 and <= max_steps): the steps a run is branched from.",
    )
    early_stopping_patience: int | None = Field(
        None, gt=0, description="Stop after N evaluations without a better val loss."
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="A non-finite loss stops the run, or the step is skipped."
    )
    sample_tokens: int = Field(
        200,
        ge=0,
        le=1_000_000,  # llmkit.inference.sampling.MAX_NEW_TOKENS, which the sample obeys
        description="Tokens of the sample printed at the end.",
    )
    sample_prompt: str = Field("", description="Prompt of the sample printed at the end.")
    parallel: Literal["auto", "none", "ddp", "fsdp"] | ParallelSpec = Field(
        "auto",
        description="Under torchrun: ddp (replicas), fsdp (FSDP2 sharding), or a table "
        "composing dp_replicate × dp_shard × cp × tp × pp on a device mesh; auto = ddp when "
        "launched on several processes. One process trains plainly.",
    )
    fsdp_cpu_offload: bool = Field(
        False, description="FSDP: keep parameters, gradients and optimizer state on the CPU."
    )
    fsdp_reshard_after_forward: bool = Field(
        True, description="FSDP: free gathered parameters after forward (less memory)."
    )
    dist_timeout: float = Field(
        600.0, gt=0, description="Seconds a collective may wait before the job fails."
    )
    init_from: str | None = Field(
        None,
        min_length=1,
        description="Start from these weights: a run directory, a checkpoint directory or a "
        ".safetensors file (never modified); the optimizer and schedule start fresh and the "
        "source's tokenizer is used unless tokenizer.path is set.",
    )
    distill: DistillSpec | None = Field(
        None, description="Distil from a teacher run (train.distill.teacher); none = off."
    )
    init_resize_vocab: bool = Field(
        False,
        description="init_from: allow a different vocabulary size (shared rows are copied, "
        "new rows keep their fresh initialisation).",
    )
    loggers: list[ComponentRef] = Field(
        default_factory=list,
        max_length=16,
        description="Experiment trackers the run's records also go to (kind logger: csv, "
        'tensorboard, wandb, mlflow, or a plugin\'s), e.g. [{ name = "csv" }]; '
        "metrics.jsonl is always written.",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not DEVICE_PATTERN.fullmatch(value):
            raise ValueError(
                f"{value[:40]!r} is not a device training can use; "
                "use auto, cpu, cuda, cuda:N or mps"
            )
        return value


class Spec(Strict):
    """A whole spec file: architecture plus training recipe."""

    name: str | None = Field(None, description="A name for this spec.")
    description: str | None = None
    extends: str | None = Field(None, description="A spec file (relative path) or preset name.")
    requires: list[str] = Field(
        default_factory=list, description="Distributions needed, e.g. 'llmkit-foo>=0.2'."
    )
    model: ModelSpec
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
