"""Contracts between the model and its components.

Every model component (attention kernel, ffn, norm, position) is an ``nn.Module`` built as
``Component(options, ctx)`` where ``options`` is an instance of the component's own pydantic
``Options`` model and ``ctx`` a :class:`BuildContext` with the model's dimensions.
Optimizers are built as ``build(model, options)`` (every param group carries
``initial_lr``) and schedules as ``build(options, total_steps=...)`` returning the lr
factor for a 0-based step (``llmkit.optim.set_lr_factor`` applies it).

The options bases (:class:`ComponentOptions`, :class:`NoOptions`, :class:`AdapterOptions`)
are defined in the torch-free :mod:`llmkit.options` and re-exported here.

This is the bottom layer, with :mod:`llmkit.options`, :mod:`llmkit.ops`, :mod:`llmkit.optim`,
:mod:`llmkit.errors` and :mod:`llmkit.hookspecs`: it imports no other part of llmkit
(``tests/test_layering.py``). Plugins import these names from ``llmkit``.

The block's open seams: the residual ``block`` kind and the ``qk_transform`` kind (a q/k hook
inside the attention module, before positions and the kernel).

**Blocks.** For every layer the model builds the attention *module* (projections, q/k
transform, positional hooks, KV cache and the kernel), the feed-forward component and a
factory of the layer's norm, and hands them to the layer's block component::

    block = Block(options, ctx, parts)  # parts: BlockParts
    x = block(x, inputs)                # x (B, T, C); inputs: AttentionInputs

A block keeps ``parts.attention`` and ``parts.ffn`` as submodules (the model checks this),
calls ``parts.norm()`` once for every norm it needs, and in ``forward`` calls
``self.attn(h, inputs)`` and ``self.ffn(h)`` on (B, T, C) tensors, passing ``inputs``
through untouched. Store them as ``attn``, ``ffn``, ``norm1``, ``norm2``… so checkpoint keys
read alike across blocks. Residual dropout is :meth:`Block.dropout`.

**Q/K transforms.** ``QKTransform(options, ctx)`` maps ``(q, k)`` of shapes (B, Hq, T, D) and
(B, Hkv, T, D) to tensors of the same shapes, token by token (keys are transformed before the
KV cache stores them, so a transform must not mix positions). The attention module applies it
before a rotary scheme and the kernel, so it works with every kernel (QK-norm before RoPE, as
in OLMo 2, Qwen3 and Gemma 3).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from llmkit.dropout import Dropout

# The options bases live in the torch-free llmkit.options (a spec is checked without torch);
# re-exported here, where components and plugins have always imported them.
from llmkit.options import AdapterOptions as AdapterOptions
from llmkit.options import ComponentOptions as ComponentOptions
from llmkit.options import NoOptions as NoOptions
from llmkit.options import ffn_hidden as ffn_hidden

#: What the component of the spec table ``train.loss`` (the training objective's seam, read by
#: ``llmkit.model.objective``) follows, whichever kind declares that section.
LOSS_CONTRACT = (
    "Loss(options) -> nn.Module; loss(logits (..., V), targets (...)) -> 0-dim float tensor: "
    "the mean over targets that are not -100 (0 with a zero gradient when all are)"
)

POSITION_SITES = ("embedding", "qk", "score_bias")


@dataclass(frozen=True)
class BuildContext:
    """The model's dimensions, handed to every model component at construction."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_seq_len: int
    n_layers: int
    layer: int = -1  # index of the block being built; -1 for model-level parts
    dropout: float = 0.0
    bias: bool = True
    dim: int = 0  # the feature size this component acts on (0 = d_model)
    qkv_bias: bool | None = None  # the attention's q/k/v projection bias (None: ``bias``)
    out_bias: bool | None = None  # the attention's output projection bias (None: ``bias``)
    attn_scale: float | None = None  # softmax scale of the scores (None: 1/√head_dim)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def features(self) -> int:
        return self.dim or self.d_model


class SideOutputs:
    """Mixin for modules that report auxiliary losses and metrics to the model output.

    Call ``self.report_loss(name, tensor)`` / ``self.report_metric(name, value)`` inside
    ``forward``; the model collects them after each forward pass under the module's path
    (e.g. ``layers.2.ffn.load_balance``). The trainer adds every loss and logs every metric.
    """

    def report_loss(self, name: str, value: Tensor) -> None:
        self.__dict__.setdefault("_side_losses", {})[name] = value

    def report_metric(self, name: str, value: float | Tensor) -> None:
        self.__dict__.setdefault("_side_metrics", {})[name] = value

    def pop_side_outputs(self) -> tuple[dict[str, Tensor], dict[str, float | Tensor]]:
        return self.__dict__.pop("_side_losses", {}), self.__dict__.pop("_side_metrics", {})


class DistanceBias:
    """A score bias linear in query-key distance with one slope per head (ALiBi form).

    ``dense`` materializes it for plain kernels; a fused kernel reads ``slopes`` directly.
    """

    def __init__(self, slopes: Tensor) -> None:
        self.slopes = slopes  # (H,)

    def dense(self, tq: int, tk: int, *, causal: bool = True) -> Tensor:
        """(H, Tq, Tk) bias for queries aligned to the last Tq of Tk keys."""
        device = self.slopes.device
        qpos = torch.arange(tk - tq, tk, device=device)[:, None]
        kpos = torch.arange(tk, device=device)[None, :]
        dist = (qpos - kpos).float()
        if not causal:
            dist = dist.abs()
        return -self.slopes.float()[:, None, None] * dist.clamp(min=0)[None]


class AttentionKernel(nn.Module):
    """The inner attention: ``softmax(q kᵀ / √d + bias) v``.

    Shapes: ``q`` (B, Hq, Tq, D); ``k``, ``v`` (B, Hkv, Tk, D) with Tk ≥ Tq and Hq a multiple
    of Hkv (GQA/MQA: kernels group heads themselves). Query i sits at key position
    ``Tk - Tq + i`` (bottom-right alignment), which is how a KV cache presents keys.
    ``key_padding_mask`` (B, Tk) is True where a key may be attended (left padding).
    Returns (B, Hq, Tq, D).

    **Document masking** (packed training rows, as Llama 3 trains): a kernel that sets
    ``supports_document_mask = True`` also takes ``document_ids`` (B, Tk), an integer id per
    key, non-decreasing along each row (queries take the ids of the last Tq keys); a query then
    attends only keys of its own document, on top of every other mask (causal, window,
    padding). The model passes ``document_ids=`` only when it has some, so a kernel without the
    keyword keeps working; but a model given document ids refuses (one ``LlmkitError`` naming
    the component, before any layer runs) every kernel that does not declare support.
    """

    #: Keys a KV cache must keep; ``None`` keeps everything (sliding windows set W).
    cache_window: int | None = None
    #: The kernel computes the reference attention (:func:`llmkit.ops.reference_attention`)
    #: and nothing else: causal softmax attention, over the last ``window`` keys when its
    #: options have a ``window`` set, with scores soft-capped when they have a ``softcap``
    #: set; its other options change only how (or how it trains). Kernels that set it are
    #: interchangeable at the same window and softcap (a Hugging Face export compares them
    #: so).
    full_causal: ClassVar[bool] = False
    #: The kernel honours ``document_ids`` (see above); False refuses packed documents.
    supports_document_mask: ClassVar[bool] = False

    def __init__(self, options: ComponentOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        self.ctx = ctx

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = True,
        bias: DistanceBias | None = None,
        key_padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError


class PositionalScheme(nn.Module):
    """A positional scheme acting in one or more of ``POSITION_SITES``.

    ``positions`` are absolute token positions, shape (T,) or (B, T).
    """

    acts_on: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, options: ComponentOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        self.ctx = ctx

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """Add position information to token embeddings x (B, T, C)."""
        return x

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Apply position to q (B, Hq, T, D) and k (B, Hkv, T, D)."""
        return q, k

    def score_bias(self) -> DistanceBias | None:
        """A bias added to attention scores, or None."""
        return None


# -- the block seams -------------------------------------------------------------------------


@dataclass
class AttentionInputs:
    """What the attention module needs besides its input, for one forward call.

    Blocks pass it to ``self.attn(h, inputs)`` without looking inside.
    """

    position: PositionalScheme  # the layer's positional scheme (q/k and score-bias sites)
    positions: Tensor  # absolute positions, (T,) or (B, T)
    cache: Any = None  # the layer's KV cache (llmkit.model.LayerCache) while decoding
    key_padding_mask: Tensor | None = None  # (B, T) of this call, True = real token
    #: (B, T) int document of each token, non-decreasing per row (packed rows; no KV cache):
    #: attention stays inside a document (``AttentionKernel.supports_document_mask``).
    document_ids: Tensor | None = None
    #: Under context parallelism (``train.parallel.cp > 1``): the group the sequence is split
    #: across (:class:`llmkit.parallel.context.ContextParallel`); ``positions`` are then the
    #: global positions of this rank's rows and attention runs over every rank's keys.
    context: Any = None


@dataclass
class BlockParts:
    """The parts of one layer, built by the model from the layer's plan."""

    attention: nn.Module  # the attention module: (h (B, T, C), AttentionInputs) -> (B, T, C)
    ffn: nn.Module  # the layer's ffn component: (B, T, C) -> (B, T, C)
    norm: Callable[[], nn.Module]  # a new norm of the layer's norm component per call


class Block(nn.Module, ABC):
    """Base of block components: ``Block(options, ctx, parts)``; ``forward(x, inputs) -> x``.

    Sets ``options``, ``ctx`` and the residual dropout ``drop`` (``ctx.dropout``).
    """

    def __init__(self, options: ComponentOptions, ctx: BuildContext, parts: BlockParts) -> None:
        super().__init__()
        self.options = options
        self.ctx = ctx
        self.drop = Dropout(ctx.dropout)

    def dropout(self, y: Tensor) -> Tensor:
        """Residual dropout of a sublayer's output (skipped in eval and when p = 0)."""
        return self.drop(y) if self.training and self.drop.p > 0 else y

    @abstractmethod
    def forward(self, x: Tensor, inputs: AttentionInputs) -> Tensor:
        """The block's output (B, T, C) for ``x`` (B, T, C)."""


class QKTransform(nn.Module, ABC):
    """Base of q/k transforms: ``QKTransform(options, ctx)``; ``forward(q, k) -> (q, k)``.

    ``q`` (B, Hq, T, D), ``k`` (B, Hkv, T, D) with D = ``ctx.head_dim``; position-wise.
    """

    def __init__(self, options: ComponentOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        self.ctx = ctx

    @abstractmethod
    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """The transformed ``(q, k)``, of the same shapes and dtype."""


class WeightAdapter(nn.Module, ABC):
    """Base of adapters: ``Adapter(options, weight)`` for one linear layer's ``weight``
    (out_features, in_features), registered as a ``torch.nn.utils.parametrize``
    parametrization of it: ``forward(weight)`` returns the adapted weight (same shape and
    dtype). The base weight is frozen; the adapter's own parameters are what trains and
    what a run saves. Merging replaces the weight by ``forward(weight)`` once, so an
    adapter must be a function of the weight alone (no dropout, no state)."""

    def __init__(self, options: AdapterOptions, weight: Tensor) -> None:
        super().__init__()
        self.options = options
        self.out_features, self.in_features = weight.shape

    @abstractmethod
    def forward(self, weight: Tensor) -> Tensor:
        """The adapted weight."""


# -- experiment trackers ----------------------------------------------------------------------


@dataclass(frozen=True)
class LoggerContext:
    """What a logger is built with: the run directory, the run's name, the run's spec (the
    mapping a tracker shows as the run's configuration), and the step a resumed run
    restarts after (None for a new run)."""

    run_dir: Path
    run_name: str
    config: dict[str, Any] = field(default_factory=dict)
    resume_step: int | None = None


class MetricsLogger(ABC):
    """Where a run's records go besides ``metrics.jsonl``: an experiment tracker.

    A record is a flat mapping: ``step`` (an int) and values — numbers (``loss``, ``lr``,
    ``val_loss``, ``capitals/acc`` from an evaluation) and occasionally strings (``eval``,
    the task's name). Components are built as ``Component(options, ctx: LoggerContext)``
    on the main process only, receive records in order, and are closed once. A resumed run
    builds them with ``ctx.resume_step`` set: records after that step are about to be
    written again, so a logger that can should drop its later ones.
    """

    @abstractmethod
    def log(self, record: dict[str, Any]) -> None:
        """Write one record."""

    def close(self) -> None:  # noqa: B027  (optional: most loggers have something to flush)
        """Flush and release what the logger holds; called once, also after an error."""
