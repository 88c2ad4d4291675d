"""The decoder-only Transformer, assembled only from resolved components.

For every layer the model builds the attention module (:class:`~llmkit.model.attention.
Attention` around the layer's kernel and optional q/k transform), the ffn and a norm factory,
and hands them to the layer's ``block`` component (:mod:`llmkit.contracts`).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from llmkit.contracts import (
    AttentionInputs,
    BlockParts,
    BuildContext,
    PositionalScheme,
    SideOutputs,
)
from llmkit.dropout import Dropout
from llmkit.errors import LlmkitError
from llmkit.model import accounting
from llmkit.model.attention import Attention
from llmkit.model.cache import KVCache
from llmkit.model.documents import check_document_ids, document_positions
from llmkit.model.meta import meta_device
from llmkit.spec import LayerPlan, Resolved, ResolvedSpec, estimate_parameters

__all__ = ["ModelOutput", "Transformer", "build", "build_model"]


@dataclass
class ModelOutput:
    """Logits plus whatever components reported through the side channel."""

    logits: Tensor
    loss: Tensor | None = None  # language-modelling cross-entropy
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def total_loss(self) -> Tensor:
        """The loss to optimize: LM loss plus every auxiliary loss."""
        if self.loss is None:
            raise ValueError("no targets were given, so there is no loss")
        total = self.loss
        for value in self.aux_losses.values():
            total = total + value
        return total


def build(resolved: Resolved, ctx: BuildContext, *args: Any) -> nn.Module:
    """Construct a model component as ``factory(options, ctx, *args)``, turning construction
    errors into user errors."""
    try:
        return resolved.build(resolved.options, ctx, *args)
    except (ValueError, TypeError) as exc:
        where = f"layer {ctx.layer}" if ctx.layer >= 0 else "model"
        raise LlmkitError(f"{resolved.kind} {resolved.name!r} ({where}): {exc}") from exc


@dataclass
class LayerParts:
    """One layer as built: its block, and the parts the block was given (the norms it
    asked for, in order), which tensor parallelism splits by their own plans."""

    block: nn.Module
    attention: Attention
    ffn: nn.Module
    norms: list[nn.Module]


def build_layer(plan: LayerPlan, ctx: BuildContext) -> LayerParts:
    """The block of one layer and its parts."""
    qk = plan.get("qk_transform")
    kernel = build(plan.attention, ctx)
    attention = Attention(ctx, kernel, build(qk, ctx) if qk is not None else None)
    ffn = build(plan.ffn, ctx)
    norms: list[nn.Module] = []

    def norm() -> nn.Module:
        norms.append(build(plan.norm, ctx))
        return norms[-1]

    parts = BlockParts(attention=attention, ffn=ffn, norm=norm)
    block = build(plan.block, ctx, parts)
    kept = {id(m) for m in block.modules()}
    for part, what in ((attention, "attention module"), (ffn, "ffn")):
        if id(part) not in kept:
            raise LlmkitError(
                f"block {plan.block.name!r} (layer {ctx.layer}) does not keep the {what} it "
                "was given as a submodule (see llmkit.contracts)"
            )
    return LayerParts(block, attention, ffn, norms)


class Transformer(nn.Module):
    """A decoder-only language model built from a :class:`ResolvedSpec`."""

    def __init__(self, rs: ResolvedSpec) -> None:
        super().__init__()
        m = rs.model
        self.spec = rs
        self.config = m
        ctx = BuildContext(
            d_model=m.d_model,
            n_heads=m.n_heads,
            n_kv_heads=m.kv_heads,
            head_dim=m.dim_head,
            max_seq_len=m.max_seq_len,
            n_layers=m.n_layers,
            dropout=m.dropout,
            bias=m.bias,
            qkv_bias=m.qkv_bias,
            out_bias=m.attn_out_bias,
            attn_scale=m.attn_scale,
        )
        self.tok_emb = nn.Embedding(m.vocab_size, m.d_model)
        self.position = build(rs.position, ctx)
        # Positional schemes chosen per layer (q/k or score-bias sites); shared when equal.
        self.layer_positions = nn.ModuleDict()
        self._position_keys: list[str] = []
        keys: dict[int, str] = {id(rs.position): ""}
        for j, plan in enumerate(rs.layers):
            if id(plan.position) not in keys:
                key = f"p{len(self.layer_positions)}"
                self.layer_positions[key] = build(plan.position, replace(ctx, layer=j))
                keys[id(plan.position)] = key
            self._position_keys.append(keys[id(plan.position)])
        self.drop = Dropout(m.dropout)
        built = [build_layer(plan, replace(ctx, layer=j)) for j, plan in enumerate(rs.layers)]
        self.layers = nn.ModuleList(part.block for part in built)
        self._attention = [part.attention for part in built]  # not registered twice
        self._ffn = [part.ffn for part in built]
        self._norms = [part.norms for part in built]
        #: Set by :func:`llmkit.parallel.tensor.parallelize_transformer` (tensor parallelism).
        self.tensor_parallel: Any = None
        #: Set by the training strategy under context parallelism (``train.parallel.cp``): a
        #: :class:`llmkit.parallel.context.ContextParallel`; ``idx`` is then this rank's part
        #: of each row (:meth:`ContextParallel.shard`) and attention spans every rank's part.
        self.context_parallel: Any = None
        self.norm_f = build(rs.norm, ctx) if m.final_norm else nn.Identity()
        self.lm_head = nn.Linear(m.d_model, m.vocab_size, bias=m.head_bias)
        scale = m.embedding_scale
        self.embedding_scale = math.sqrt(m.d_model) if scale == "sqrt_d_model" else float(scale)
        self.logit_softcap = m.logit_softcap
        if m.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()
        self.activation_checkpointing = False
        self._reporters = [
            (n, mod) for n, mod in self.named_modules() if isinstance(mod, SideOutputs)
        ]

    @property
    def attention_modules(self) -> list[Attention]:
        """Each layer's attention module, in layer order (wherever its block keeps it)."""
        return self._attention

    @property
    def ffn_modules(self) -> list[nn.Module]:
        """Each layer's ffn, in layer order."""
        return self._ffn

    @property
    def norm_modules(self) -> list[list[nn.Module]]:
        """The norms each layer's block asked for, in order."""
        return self._norms

    # -- init --------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Normal(0, init_std) for linear and embedding weights, zero biases; output
        projections named ``out_proj`` scaled by 1/sqrt(2·n_layers) (GPT-2). A module with
        its own ``init_weights(std)`` method initializes itself."""
        m = self.config
        std = m.init_std
        residual_std = std / math.sqrt(2 * m.n_layers) if m.scaled_residual_init else std
        self_init: list[str] = []  # modules that initialize themselves, and their children
        for name, mod in self.named_modules():
            if any(name.startswith(f"{p}.") for p in self_init):
                continue
            if mod is not self and hasattr(mod, "init_weights"):
                params = inspect.signature(mod.init_weights).parameters
                if "residual_std" in params:
                    mod.init_weights(std, residual_std=residual_std)
                else:
                    mod.init_weights(std)
                self_init.append(name)
            elif isinstance(mod, nn.Linear):
                is_out = name.rsplit(".", 1)[-1] == "out_proj"
                nn.init.normal_(mod.weight, 0.0, residual_std if is_out else std)
                if mod.bias is not None:
                    nn.init.zeros_(mod.bias)
            elif isinstance(mod, nn.Embedding):
                nn.init.normal_(mod.weight, 0.0, std)

    # -- forward -----------------------------------------------------------------------------
    def layer_position(self, j: int) -> PositionalScheme:
        key = self._position_keys[j]
        return self.position if not key else self.layer_positions[key]

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        last_only: bool = False,
        document_ids: Tensor | None = None,
    ) -> ModelOutput:
        """``idx`` (B, T) token ids; ``targets`` (B, T) with -100 to ignore.

        With a ``cache``, ``idx`` holds only the new tokens and positions continue from the
        cache. ``key_padding_mask`` marks real tokens (True) against padding (False): (B, T)
        for the tokens of this call (a cache remembers earlier ones) or, with a cache,
        (B, cache.position + T) for every token so far. With a mask, a token's default
        position is the number of real tokens before it in its row, so a left-padded prompt
        is positioned exactly as if it were alone. ``positions`` (T,) or (B, T) overrides
        the default positions. ``last_only`` computes the logits of the last position only.

        ``document_ids`` (B, T) integer, non-decreasing along each row, marks the documents
        of packed rows (:func:`llmkit.model.documents.document_ids_from_eos`): a token attends
        only to earlier tokens of its own document, and its default position is its index
        within the document, so each document gets the logits it would get alone. Every
        layer's attention kernel must declare ``supports_document_mask`` (checked before the
        first layer runs); a KV cache is refused with it.
        """
        T = idx.shape[1]
        cp = self.context_parallel
        if cp is not None:
            if cache is not None or last_only or key_padding_mask is not None:
                raise LlmkitError(
                    "a context-parallel model trains and evaluates whole rows; generate from "
                    "its checkpoint (whole weights) instead"
                )
            if document_ids is not None:
                raise LlmkitError("document masking cannot be combined with context parallelism")
            if positions is None:  # the global positions of this rank's chunks
                positions = cp.positions(T * cp.cp, idx.device)
        if document_ids is not None:
            document_ids = self._check_documents(document_ids, idx, cache)
        if key_padding_mask is not None:
            key_padding_mask = self._new_token_mask(key_padding_mask, idx, cache)
        if cache is not None and key_padding_mask is not None and cache.seen is None:
            # the first mask: every row so far held real tokens only
            cache.seen = torch.full(
                (idx.shape[0],), cache.position, dtype=torch.long, device=idx.device
            )
        if positions is None and document_ids is not None:
            positions = document_positions(document_ids, key_padding_mask)
        elif positions is None:
            positions = self._default_positions(idx, cache, key_padding_mask)
        if cache is not None and cache.seen is not None:
            real = T if key_padding_mask is None else key_padding_mask.sum(1)
            cache.seen = cache.seen + real
        x = self.tok_emb(idx)  # (B, T, C)
        if self.embedding_scale != 1.0:  # Gemma: √d_model, rounded to the activations' dtype
            x = x * torch.tensor(self.embedding_scale, dtype=x.dtype)
        x = self.position.embed(x, positions)
        if self.training and self.drop.p > 0:
            x = self.drop(x)
        tp = self.tensor_parallel
        if tp is not None:
            if cache is not None or last_only:
                raise LlmkitError(
                    "a tensor-parallel model trains and evaluates; generate from its "
                    "checkpoint (whole weights) instead"
                )
            x = tp.split_sequence(x)  # sequence parallelism between layers
        recompute = self.activation_checkpointing and self.training and cache is None
        for j, block in enumerate(self.layers):
            inputs = AttentionInputs(
                self.layer_position(j),
                positions,
                cache.layers[j] if cache is not None else None,
                key_padding_mask,
                document_ids,
                cp,
            )
            x = checkpoint(block, x, inputs, use_reentrant=False) if recompute else block(x, inputs)
        if cache is not None:
            cache.position += T
        if last_only and targets is None:
            x = x[:, -1:, :]  # norms act per token, so slicing first is exact
        x = self.norm_f(x)
        logits = self.lm_head(x)
        if self.logit_softcap is not None:  # Gemma 2: c·tanh(logits/c)
            c = self.logit_softcap
            logits = torch.tanh(logits / c) * c
        loss = None
        if tp is not None:
            if targets is not None:
                loss = tp.cross_entropy(logits, targets)
            if targets is None or not self.training:
                logits = tp.whole(logits)
        elif targets is not None:
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
            )
        aux, metrics = self.collect_side_outputs()
        return ModelOutput(logits, loss, aux, metrics)

    def _check_documents(self, document_ids: Tensor, idx: Tensor, cache: KVCache | None) -> Tensor:
        """The checks of ``document_ids`` before any layer runs: no KV cache, every kernel
        declares support, ids shaped like ``idx`` and non-decreasing."""
        if cache is not None:
            raise LlmkitError(
                "Transformer.forward: document_ids cannot be combined with a KV cache "
                "(document masking is for packed training rows; decode documents one by one)"
            )
        for j, attention in enumerate(self._attention):
            if not getattr(attention.kernel, "supports_document_mask", False):
                name = self.spec.layers[j].attention.name
                raise LlmkitError(
                    f"attention {name!r} (layer {j}) does not support document masking "
                    "(document_ids / data.document_mask): its kernel does not declare "
                    "supports_document_mask = True"
                )
        return check_document_ids(document_ids, idx)

    @staticmethod
    def _new_token_mask(mask: Tensor, idx: Tensor, cache: KVCache | None) -> Tensor:
        b, t = idx.shape
        mask = mask.to(device=idx.device, dtype=torch.bool)
        total = t + (cache.position if cache is not None else 0)
        if mask.dim() != 2 or mask.shape[0] != b or mask.shape[1] not in (t, total):
            expected = f"({b}, {t})" + (f" or ({b}, {total})" if total != t else "")
            raise ValueError(f"key_padding_mask has shape {tuple(mask.shape)}; expected {expected}")
        return mask[:, -t:] if t else mask[:, :0]

    @staticmethod
    def _default_positions(idx: Tensor, cache: KVCache | None, mask: Tensor | None) -> Tensor:
        t = idx.shape[1]
        if mask is None and (cache is None or cache.seen is None):
            start = cache.position if cache is not None else 0
            return torch.arange(start, start + t, device=idx.device)
        before = cache.seen if cache is not None and cache.seen is not None else None
        if mask is None:
            assert before is not None
            return before[:, None] + torch.arange(t, device=idx.device)
        m = mask.long()
        pos = m.cumsum(1) - m  # real tokens before each token of this call
        return pos if before is None else pos + before[:, None]

    @property
    def supports_kv_cache(self) -> bool:
        """Whether every layer's components can decode through a KV cache: the attention
        must declare ``kv_cache = true`` in its capabilities (as the conformance suite
        assumes); any other component may opt out with ``kv_cache = false``."""
        for plan in self.spec.layers:
            if not plan.attention.record.capabilities.get("kv_cache", False):
                return False
            for slot, part in plan.slots.items():
                if slot != "attention" and part.record.capabilities.get("kv_cache", True) is False:
                    return False
        return self.spec.position.record.capabilities.get("kv_cache", True) is not False

    def collect_side_outputs(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        aux: dict[str, Tensor] = {}
        metrics: dict[str, Any] = {}
        for name, mod in self._reporters:
            losses, mets = mod.pop_side_outputs()
            aux.update({f"{name}.{k}": v for k, v in losses.items()})
            metrics.update({f"{name}.{k}": v for k, v in mets.items()})
        return aux, metrics

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty KV cache; ``capacity`` (tokens) preallocates its buffers."""
        return KVCache(self, capacity)

    # -- accounting (llmkit.model.accounting) ------------------------------------------------
    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters; optionally without token and position embeddings."""
        return accounting.num_params(self, exclude_embeddings)

    def active_params(self) -> int:
        """Parameters used per token (routed experts count only when active)."""
        return accounting.active_params(self)

    def flops_per_token(self, seq_len: int | None = None) -> dict[str, float]:
        """Forward and training FLOPs per token (PaLM appendix B)."""
        return accounting.flops_per_token(self, seq_len)

    def kv_cache_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V stored per token."""
        return accounting.kv_cache_bytes_per_token(self, dtype)

    def training_memory(
        self,
        batch_size: int,
        seq_len: int | None = None,
        *,
        param_bytes: int = 4,
        activation_bytes: int = 2,
        optimizer_states: int = 2,
    ) -> dict[str, int]:
        """Estimated bytes a training step needs (Korthikanti et al. 2022)."""
        return accounting.training_memory(
            self,
            batch_size,
            seq_len,
            param_bytes=param_bytes,
            activation_bytes=activation_bytes,
            optimizer_states=optimizer_states,
        )


def build_model(rs: ResolvedSpec) -> Transformer:
    """Build the model a resolved spec describes."""
    return Transformer(rs)


def build_on_meta(rs: ResolvedSpec) -> Transformer:
    """The spec's model on the meta device: shapes only, no memory, no values (built without
    importing ``torch._dynamo`` where the build needs nothing of it: :mod:`.meta`)."""
    try:
        with meta_device() as stand_in:
            model = build_model(rs)
    except Exception:
        if stand_in is None or not stand_in.missing:
            raise
    else:
        if stand_in is None or not stand_in.missing:
            return model
    import torch._dynamo  # noqa: F401  (the build asked for more than the stand-in has)

    with meta_device():
        return build_model(rs)


#: Models estimated (:func:`llmkit.spec.estimate_parameters`, from the spec's shapes and
#: what the ffns' options count) at up to this many parameters are built for real, on the CPU
#: with the RNG state kept, to check a spec: the speedrun's 0.8M-parameter model in 0.03 s,
#: against 0.6 s for a first build on the meta device (whose Python decompositions import
#: sympy).
CHECK_ON_CPU_PARAMS = 16_000_000


def build_problems(rs: ResolvedSpec) -> list[str]:
    """What stops the spec's model from being built — a component refusing its dimensions
    (RoPE on an odd head size) — found before any data is read by building it: on the meta
    device (no memory, no weights), or on the CPU when it is small
    (:data:`CHECK_ON_CPU_PARAMS`, counting the parameters and one ``max_seq_len × d_model``
    table, which the estimate leaves out: positional tables are that size). Empty when it
    builds."""
    m = rs.spec.model
    size = estimate_parameters(rs.spec, rs.layers) + m.max_seq_len * m.d_model
    try:
        if size <= CHECK_ON_CPU_PARAMS:
            with torch.random.fork_rng(devices=[]), torch.device("cpu"):
                build_model(rs)
        else:
            build_on_meta(rs)
    except (LlmkitError, ValueError) as exc:  # what components raise for bad dimensions
        return [str(exc)]
    except NotImplementedError:  # an op the meta device lacks: the real build will tell
        return []
    return []
