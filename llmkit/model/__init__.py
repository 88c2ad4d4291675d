"""The decoder-only Transformer, assembled only from resolved components.

The attention *module* here owns the projections, the positional hooks and the KV cache;
the attention *kernel* (a registered component) only computes softmax(QKᵀ/√d + bias)V.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from llmkit.contracts import (
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
    """Keys and values of one layer in preallocated buffers (B, Hkv, capacity, D).

    Without a window the buffers grow geometrically (doubling) and usually never grow at
    all: :meth:`Transformer.new_cache` takes a ``capacity`` hint. With a ``window`` W the
    layer keeps only the last W keys in a rolling buffer of W + S slots: new keys are
    written after the kept ones, and when the buffer is full the last W are moved to the
    front (one O(W) copy every S tokens, S = min(W, 128)). Keys therefore stay in
    chronological order, as the kernel contract (bottom-right alignment, distance biases,
    padding masks) requires, and memory never grows with the generated length.

    An optional boolean ``mask`` buffer (B, capacity), True = real token, follows the keys
    once any update brings a key padding mask (left-padded batches).
    """

    #: Free slots a windowed buffer keeps beyond its window (at most; ≤ W).
    WINDOW_SLACK = 128

    def __init__(self, window: int | None = None, capacity: int | None = None) -> None:
        self.window = window
        self.capacity_hint = capacity
        self.k: Tensor | None = None  # buffers; valid entries are [start, end)
        self.v: Tensor | None = None
        self.mask: Tensor | None = None
        self.start = 0
        self.end = 0

    @property
    def length(self) -> int:
        """Keys kept (at most ``window`` for a windowed layer)."""
        return self.end - self.start

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def keys(self) -> tuple[Tensor, Tensor]:
        """Views of the kept keys and values (B, Hkv, length, D)."""
        if self.k is None or self.v is None:
            raise ValueError("the cache is empty")
        return self.k[:, :, self.start : self.end], self.v[:, :, self.start : self.end]

    def _initial_capacity(self, t: int) -> int:
        if self.window is not None:
            cap = self.window + min(self.window, self.WINDOW_SLACK)
            if self.capacity_hint is not None:
                cap = min(cap, max(self.capacity_hint, self.window))
            return cap
        return max(t, self.capacity_hint or 0, 16)

    def _allocate(self, like: Tensor, capacity: int, rows: int | None = None) -> None:
        b, h, _, d = like.shape
        shape = (rows or b, h, capacity, d)
        k = like.new_empty(shape)
        v = like.new_empty(shape)
        mask = None
        if self.mask is not None:
            mask = torch.ones(shape[0], capacity, dtype=torch.bool, device=like.device)
        n = self.length
        if self.k is not None and n:
            k[:, :, :n] = self.k[:, :, self.start : self.end]
            v[:, :, :n] = self.v[:, :, self.start : self.end]
            if mask is not None and self.mask is not None:
                mask[:, :n] = self.mask[:, self.start : self.end]
        self.k, self.v, self.mask = k, v, mask
        self.start, self.end = 0, n

    def _compact(self) -> None:
        """Move the kept keys to the front of the buffers (windowed layers)."""
        n, s = self.length, self.start
        if s == 0:
            return
        for buf in (self.k, self.v):
            src = buf[:, :, s : s + n]
            buf[:, :, :n] = src.clone() if s < n else src  # overlapping ranges need a copy
        if self.mask is not None:
            src = self.mask[:, s : s + n]
            self.mask[:, :n] = src.clone() if s < n else src
        self.start, self.end = 0, n

    def _ensure_mask(self, rows: int, device: torch.device) -> Tensor:
        if self.mask is None:
            self.mask = torch.ones(rows, self.capacity, dtype=torch.bool, device=device)
        return self.mask

    def update(
        self, k: Tensor, v: Tensor, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store new keys/values (B, Hkv, T, D) and, optionally, their padding mask (B, T).

        Returns every key the new queries may see, the new ones last, with the matching
        padding mask (None when no mask was ever given)."""
        t = k.shape[2]
        if self.k is None:
            self._allocate(k, self._initial_capacity(t))
        assert self.k is not None and self.v is not None
        if self.window is not None and self.length + t > self.capacity:
            return self._update_wide(k, v, mask)
        if self.end + t > self.capacity:
            if self.window is not None:
                self._compact()
            else:
                self._allocate(k, max(2 * self.capacity, self.end + t))
        lo, s, e = self.start, self.end, self.end + t
        self.k[:, :, s:e] = k
        self.v[:, :, s:e] = v
        if mask is not None or self.mask is not None:
            buf = self._ensure_mask(k.shape[0], k.device)
            buf[:, s:e] = True if mask is None else mask
        self.end = e
        if self.window is not None:
            self.start = max(lo, e - self.window)
        out_mask = None if self.mask is None else self.mask[:, lo:e]
        return self.k[:, :, lo:e], self.v[:, :, lo:e], out_mask

    def _update_wide(
        self, k: Tensor, v: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """A chunk too large for a windowed buffer: attend over kept + new, keep the last W."""
        assert self.k is not None and self.v is not None and self.window is not None
        old_k, old_v = self.keys()
        k_all, v_all = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        m_all = None
        if mask is not None or self.mask is not None:
            b, t = k.shape[0], k.shape[2]
            old_m = (
                self.mask[:, self.start : self.end]
                if self.mask is not None
                else torch.ones(b, self.length, dtype=torch.bool, device=k.device)
            )
            new_m = (
                mask if mask is not None else torch.ones(b, t, dtype=torch.bool, device=k.device)
            )
            m_all = torch.cat([old_m, new_m.to(torch.bool)], dim=1)
        n = min(self.window, k_all.shape[2])
        self.k[:, :, :n] = k_all[:, :, -n:]
        self.v[:, :, :n] = v_all[:, :, -n:]
        if m_all is not None:
            self._ensure_mask(k.shape[0], k.device)[:, :n] = m_all[:, -n:]
        self.start, self.end = 0, n
        return k_all, v_all, m_all

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (B',) in that order (beam search, finished rows)."""
        if self.k is None or self.v is None:
            return
        self.k = self.k.index_select(0, index)
        self.v = self.v.index_select(0, index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)

    def nbytes(self) -> int:
        """Bytes of the allocated buffers."""
        total = 0
        for buf in (self.k, self.v, self.mask):
            if buf is not None:
                total += buf.numel() * buf.element_size()
        return total


class KVCache:
    """Per-layer caches plus the position of the next token.

    ``position`` counts every token fed so far (padding included); ``seen`` (B,) counts
    each row's real tokens once a key padding mask has been given (left padding), so the
    next token of row b sits at position ``seen[b]``.
    """

    def __init__(self, model: Transformer, capacity: int | None = None) -> None:
        self.layers = [
            LayerCache(block.attn.kernel.cache_window, capacity) for block in model.layers
        ]
        self.position = 0
        self.seen: Tensor | None = None

    @property
    def key_padding_mask(self) -> Tensor | None:
        """The padding mask of the keys the first layer keeps (True = real token)."""
        layer = self.layers[0] if self.layers else None
        if layer is None or layer.mask is None:
            return None
        return layer.mask[:, layer.start : layer.end]

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` in that order, in every layer."""
        for layer in self.layers:
            layer.reorder(index)
        if self.seen is not None:
            self.seen = self.seen.index_select(0, index)

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)


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
            k, v, key_padding_mask = cache.update(k, v, key_padding_mask)
        elif key_padding_mask is not None:
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
        drop = self.drop if self.training and self.drop.p > 0 else _identity
        if self.pre_norm:
            x = x + drop(self.attn(self.norm1(x), position, positions, cache, key_padding_mask))
            return x + drop(self.ffn(self.norm2(x)))
        x = self.norm1(x + drop(self.attn(x, position, positions, cache, key_padding_mask)))
        return self.norm2(x + drop(self.ffn(x)))


def _identity(x: Tensor) -> Tensor:
    return x


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
    ) -> ModelOutput:
        """``idx`` (B, T) token ids; ``targets`` (B, T) with -100 to ignore.

        With a ``cache``, ``idx`` holds only the new tokens and positions continue from the
        cache. ``key_padding_mask`` marks real tokens (True) against padding (False): (B, T)
        for the tokens of this call (a cache remembers earlier ones) or, with a cache,
        (B, cache.position + T) for every token so far. With a mask, a token's default
        position is the number of real tokens before it in its row, so a left-padded prompt
        is positioned exactly as if it were alone. ``positions`` (T,) or (B, T) overrides
        the default positions. ``last_only`` computes the logits of the last position only.
        """
        T = idx.shape[1]
        if key_padding_mask is not None:
            key_padding_mask = self._new_token_mask(key_padding_mask, idx, cache)
        if cache is not None and key_padding_mask is not None and cache.seen is None:
            # the first mask: every row so far held real tokens only
            cache.seen = torch.full(
                (idx.shape[0],), cache.position, dtype=torch.long, device=idx.device
            )
        if positions is None:
            positions = self._default_positions(idx, cache, key_padding_mask)
        if cache is not None and cache.seen is not None:
            real = T if key_padding_mask is None else key_padding_mask.sum(1)
            cache.seen = cache.seen + real
        x = self.tok_emb(idx)  # (B, T, C)
        x = self.position.embed(x, positions)
        if self.training and self.drop.p > 0:
            x = self.drop(x)
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
        if last_only and targets is None:
            x = x[:, -1:, :]  # norms act per token, so slicing first is exact
        x = self.norm_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
            )
        aux, metrics = self.collect_side_outputs()
        return ModelOutput(logits, loss, aux, metrics)

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
            for part in (plan.ffn, plan.norm, plan.position):
                if part.record.capabilities.get("kv_cache", True) is False:
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
