"""The decoder-only Transformer, assembled only from resolved components.

The attention *module* here owns the projections, the positional hooks and the KV cache;
the attention *kernel* (a registered component) only computes softmax(QKᵀ/√d + bias)V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from llmkit.components.base import (
    AttentionKernel,
    BuildContext,
    PositionalScheme,
    SideOutputs,
)
from llmkit.errors import LlmkitError
from llmkit.spec import LayerPlan, Resolved, ResolvedSpec


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


class LayerCache:
    """Keys and values of one layer; keeps only the last ``window`` entries when set."""

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append new keys/values (B, Hkv, T, D); return everything the queries may see."""
        if self.k is not None:
            k = torch.cat([self.k, k], dim=2)
            v = torch.cat([self.v, v], dim=2)
        keep = k if self.window is None else k[:, :, -self.window :]
        self.k, self.v = keep, (v if self.window is None else v[:, :, -self.window :])
        return k, v

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]


class KVCache:
    """Per-layer caches plus the absolute position of the next token."""

    def __init__(self, model: Transformer) -> None:
        self.layers = [LayerCache(block.attn.kernel.cache_window) for block in model.layers]
        self.position = 0
        self.key_padding_mask: Tensor | None = None  # (B, keys seen so far), for left padding

    def nbytes(self) -> int:
        return sum(c.k.numel() * c.k.element_size() * 2 for c in self.layers if c.k is not None)


class Attention(nn.Module):
    """Projections, positional hooks and KV cache around an attention kernel."""

    def __init__(self, ctx: BuildContext, kernel: AttentionKernel) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = ctx.n_heads, ctx.n_kv_heads, ctx.head_dim
        qkv_out = (ctx.n_heads + 2 * ctx.n_kv_heads) * ctx.head_dim
        self.qkv = nn.Linear(ctx.d_model, qkv_out, bias=ctx.bias)
        self.out_proj = nn.Linear(ctx.n_heads * ctx.head_dim, ctx.d_model, bias=ctx.bias)
        self.kernel = kernel

    def forward(
        self,
        x: Tensor,
        position: PositionalScheme,
        positions: Tensor,
        cache: LayerCache | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        q, k = position.rotate(q, k, positions)
        if cache is not None:
            k, v = cache.update(k, v)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask[:, -k.shape[2] :]
        y = self.kernel(
            q, k, v, causal=True, bias=position.score_bias(), key_padding_mask=key_padding_mask
        )
        y = y.transpose(1, 2).reshape(B, T, H * D)
        return self.out_proj(y)


class Block(nn.Module):
    """One Transformer block: attention and ffn, each with a norm and a residual."""

    def __init__(self, plan: LayerPlan, ctx: BuildContext, pre_norm: bool) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.norm1 = build(plan.norm, ctx)
        self.attn = Attention(ctx, build(plan.attention, ctx))
        self.norm2 = build(plan.norm, ctx)
        self.ffn = build(plan.ffn, ctx)
        self.drop = nn.Dropout(ctx.dropout)

    def forward(
        self,
        x: Tensor,
        position: PositionalScheme,
        positions: Tensor,
        cache: LayerCache | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        if self.pre_norm:
            x = x + self.drop(
                self.attn(self.norm1(x), position, positions, cache, key_padding_mask)
            )
            return x + self.drop(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.drop(self.attn(x, position, positions, cache, key_padding_mask)))
        return self.norm2(x + self.drop(self.ffn(x)))


def build(resolved: Resolved, ctx: BuildContext) -> nn.Module:
    """Construct a model component, turning construction errors into user errors."""
    try:
        return resolved.build(resolved.options, ctx)
    except (ValueError, TypeError) as exc:
        where = f"layer {ctx.layer}" if ctx.layer >= 0 else "model"
        raise LlmkitError(f"{resolved.kind} {resolved.name!r} ({where}): {exc}") from exc


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
                self.layer_positions[key] = build(plan.position, _at(ctx, j))
                keys[id(plan.position)] = key
            self._position_keys.append(keys[id(plan.position)])
        self.drop = nn.Dropout(m.dropout)
        self.layers = nn.ModuleList(
            Block(plan, _at(ctx, j), m.norm_placement == "pre") for j, plan in enumerate(rs.layers)
        )
        self.norm_f = build(rs.norm, ctx) if m.final_norm else nn.Identity()
        self.lm_head = nn.Linear(m.d_model, m.vocab_size, bias=False)
        if m.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()
        self.activation_checkpointing = False
        self._reporters = [
            (n, mod) for n, mod in self.named_modules() if isinstance(mod, SideOutputs)
        ]

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
    ) -> ModelOutput:
        """``idx`` (B, T) token ids; ``targets`` (B, T) with -100 to ignore.

        With a ``cache``, ``idx`` holds only the new tokens and positions continue from
        ``cache.position``. ``key_padding_mask`` (B, T_total) marks real tokens (left
        padding); ``positions`` (T,) or (B, T) overrides the default positions.
        """
        T = idx.shape[1]
        start = cache.position if cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + T, device=idx.device)
        if cache is not None and key_padding_mask is not None:
            cache.key_padding_mask = key_padding_mask
        x = self.tok_emb(idx)  # (B, T, C)
        x = self.drop(self.position.embed(x, positions))
        recompute = self.activation_checkpointing and self.training and cache is None
        for j, block in enumerate(self.layers):
            layer_cache = cache.layers[j] if cache is not None else None
            if recompute:
                x = checkpoint(
                    block,
                    x,
                    self.layer_position(j),
                    positions,
                    None,
                    key_padding_mask,
                    use_reentrant=False,
                )
            else:
                x = block(x, self.layer_position(j), positions, layer_cache, key_padding_mask)
        if cache is not None:
            cache.position += T
        x = self.norm_f(x)
        if last_only and targets is None:
            x = x[:, -1:, :]
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
            )
        aux, metrics = self.collect_side_outputs()
        return ModelOutput(logits, loss, aux, metrics)

    def collect_side_outputs(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        aux: dict[str, Tensor] = {}
        metrics: dict[str, Any] = {}
        for name, mod in self._reporters:
            losses, mets = mod.pop_side_outputs()
            aux.update({f"{name}.{k}": v for k, v in losses.items()})
            metrics.update({f"{name}.{k}": v for k, v in mets.items()})
        return aux, metrics

    def new_cache(self) -> KVCache:
        return KVCache(self)

    # -- accounting --------------------------------------------------------------------------
    def _embedding_params(self) -> set[int]:
        ids = {id(self.tok_emb.weight)}
        ids.update(id(p) for p in self.position.parameters())
        return ids

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters; optionally without token and position embeddings."""
        skip = self._embedding_params() if exclude_embeddings else set()
        seen: set[int] = set()
        total = 0
        for p in self.parameters():
            if id(p) in seen or id(p) in skip:
                continue
            seen.add(id(p))
            total += p.numel()
        return total

    def active_params(self) -> int:
        """Parameters used per token: components may report fewer (e.g. routed experts)
        through an ``active_parameters()`` method."""
        total = self.num_params()
        for mod in self.modules():
            fn = getattr(mod, "active_parameters", None)
            if mod is not self and callable(fn):
                total -= sum(p.numel() for p in mod.parameters()) - int(fn())
        return total

    def flops_per_token(self, seq_len: int | None = None) -> dict[str, float]:
        """Forward and training FLOPs per token (PaLM appendix B: 6N + 12·L·H·Q·T for
        training), counting active parameters and each layer's attention span."""
        m = self.config
        T = seq_len or m.max_seq_len
        matmul = self.active_params() - sum(
            p.numel() for p in self.parameters() if id(p) in self._embedding_params()
        )
        if m.tie_embeddings:
            matmul += m.vocab_size * m.d_model  # the output head still multiplies
        attn = 0.0
        for block in self.layers:
            window = block.attn.kernel.cache_window
            span = min(T, window) if window else T
            attn += 4 * m.n_heads * m.dim_head * span
        forward = 2 * matmul + attn
        return {"forward": forward, "train": 3 * forward}

    def kv_cache_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V stored per token (sliding-window layers stop growing at W)."""
        size = torch.empty(0, dtype=dtype).element_size()
        return len(self.layers) * 2 * self.config.kv_heads * self.config.dim_head * size

    def training_memory(
        self,
        batch_size: int,
        seq_len: int | None = None,
        *,
        param_bytes: int = 4,
        activation_bytes: int = 2,
        optimizer_states: int = 2,
    ) -> dict[str, int]:
        """Estimated bytes a training step needs: weights, grads, optimizer state, and
        activations from Korthikanti et al. 2022 (sbh·(34 + 5as/h) per layer at 16-bit,
        without the 5as/h score term for fused kernels that never store the scores)."""
        m = self.config
        s = seq_len or m.max_seq_len
        n = self.num_params()
        b, h, a = batch_size, m.d_model, m.n_heads
        act = 0.0
        for plan in self.spec.layers:
            stores_scores = plan.attention.record.capabilities.get("materializes_scores", False)
            per = 34 + (5 * a * s / h if stores_scores else 0)
            act += s * b * h * per * activation_bytes / 2
        logits = b * s * m.vocab_size * 4 * 2  # fp32 logits and their gradient
        out = {
            "weights": n * param_bytes,
            "gradients": n * param_bytes,
            "optimizer": n * 4 * optimizer_states,
            "activations": int(act) + logits,
        }
        out["total"] = sum(out.values())
        return out


def _at(ctx: BuildContext, layer: int) -> BuildContext:
    from dataclasses import replace

    return replace(ctx, layer=layer)


def build_model(rs: ResolvedSpec) -> Transformer:
    """Build the model a resolved spec describes."""
    return Transformer(rs)
