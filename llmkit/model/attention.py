"""The attention *module*: projections, the q/k transform, positional hooks, the KV cache and
the call of the attention *kernel* (a registered component computing softmax(QKᵀ/√d + bias)V).
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from llmkit.contracts import AttentionInputs, AttentionKernel, BuildContext, DistanceBias
from llmkit.errors import LlmkitError

__all__ = ["Attention"]


class Attention(nn.Module):
    """Fused QKV projection (rows: q heads, then k heads, then v heads), output projection
    ``out_proj`` and the kernel; their biases follow ``ctx.qkv_bias`` / ``ctx.out_bias``.

    Per call: project, apply the optional ``qk_transform`` to q and k (QK-norm), then the
    positional scheme's q/k rotation, scale q when the softmax scale is not 1/√D
    (``ctx.attn_scale``), store k and v in the cache, and run the kernel with the scheme's
    score bias (and ``inputs.document_ids``, passed only when set, so a kernel without the
    keyword still runs without documents). Keys are cached after the transform and the
    rotation, so decoding never recomputes them.
    """

    def __init__(
        self, ctx: BuildContext, kernel: AttentionKernel, qk_transform: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = ctx.n_heads, ctx.n_kv_heads, ctx.head_dim
        qkv_out = (ctx.n_heads + 2 * ctx.n_kv_heads) * ctx.head_dim
        qkv_bias = ctx.bias if ctx.qkv_bias is None else ctx.qkv_bias
        out_bias = ctx.bias if ctx.out_bias is None else ctx.out_bias
        self.qkv = nn.Linear(ctx.d_model, qkv_out, bias=qkv_bias)
        self.out_proj = nn.Linear(ctx.n_heads * ctx.head_dim, ctx.d_model, bias=out_bias)
        self.kernel = kernel
        self.qk_transform = qk_transform
        # Kernels scale scores by 1/√D; another softmax scale s multiplies q by s·√D first.
        scale = ctx.attn_scale
        self.q_multiplier = None if scale is None else scale * math.sqrt(ctx.head_dim)
        #: Under tensor parallelism (:meth:`split_heads`): the first of this rank's heads,
        #: and the fused projection's rows are in key/value-head groups.
        self.head_offset = 0
        self.grouped = False
        #: Under tensor parallelism over more ranks than key/value heads: this rank's rows of
        #: the whole (replicated) fused projection — its query heads and its group's key and
        #: value head (:meth:`split_heads`).
        self.shared_kv_rows: Tensor | None
        self.register_buffer("shared_kv_rows", None, persistent=False)  # moves with the model

    def split_heads(self, tp: int, rank: int) -> Tensor | None:
        """Prepare for tensor parallelism over ``tp`` ranks (this one ``rank``): reorder the
        fused projection's rows into key/value-head groups (each group's query heads, its
        key head, its value head), so that a split of the rows gives each rank whole groups,
        and keep ``n_heads / tp`` heads here. Returns the reordering (row indices).

        With more ranks than key/value heads (MQA, or GQA with tp > n_kv_heads) the fused
        projection stays whole on every rank instead (None returned): each rank computes
        its query heads and its group's key/value head from it (:attr:`shared_kv_rows`),
        and the projection's gradient and the input's are summed over the ranks."""
        import torch

        from llmkit.parallel.tensor import grouped_rows

        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        if H % tp or (Hkv % tp and tp % Hkv):
            raise LlmkitError(
                f"tensor parallelism over {tp} ranks needs n_heads ({H}) to be a multiple of "
                f"{tp} and n_kv_heads ({Hkv}) a multiple or a divisor of it"
            )
        if Hkv % tp:  # more ranks than kv heads: each rank copies its group's kv head
            if self.qk_transform is not None:
                raise LlmkitError(
                    f"tensor parallelism over {tp} ranks with {Hkv} key/value head(s) copies "
                    "key heads to several ranks, which a q/k transform (QK-norm) does not "
                    "support; use tp ≤ n_kv_heads"
                )
            per_rank = H // tp
            self.head_offset = rank * per_rank
            kv_head = self.head_offset // (H // Hkv)
            self.shared_kv_rows = torch.cat(
                [
                    torch.arange(self.head_offset * D, (self.head_offset + per_rank) * D),
                    torch.arange((H + kv_head) * D, (H + kv_head + 1) * D),
                    torch.arange((H + Hkv + kv_head) * D, (H + Hkv + kv_head + 1) * D),
                ]
            ).to(self.qkv.weight.device)
            self.n_heads, self.n_kv_heads = per_rank, 1
            return None
        rows = grouped_rows(H, Hkv, D)
        with torch.no_grad():
            self.qkv.weight.copy_(self.qkv.weight[rows.to(self.qkv.weight.device)])
            if self.qkv.bias is not None:
                self.qkv.bias.copy_(self.qkv.bias[rows.to(self.qkv.bias.device)])
        self.n_heads, self.n_kv_heads = H // tp, Hkv // tp
        self.head_offset = rank * self.n_heads
        self.grouped = True
        return rows

    def _shared_kv_projection(self, x: Tensor) -> Tensor:
        """This rank's rows of the whole fused projection (:meth:`split_heads`); the weight's
        and the input's gradients are partial here (this rank's rows) and summed over the
        tensor-parallel ranks, the copies of a key/value head included."""
        import torch.nn.functional as F

        from llmkit.parallel.experts import local_part, summed_gradient

        rows = self.shared_kv_rows
        weight, mesh = local_part(self.qkv.weight)  # whole, its gradient summed over ranks
        b = None if self.qkv.bias is None else local_part(self.qkv.bias)[0][rows]
        return F.linear(summed_gradient(x, mesh.get_group()), weight[rows], b)

    def forward(self, x: Tensor, inputs: AttentionInputs) -> Tensor:
        """``x`` (B, T, C) → (B, T, C)."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        if self.shared_kv_rows is not None:
            q, k, v = self._shared_kv_projection(x).split([H * D, D, D], dim=-1)
            q = q.view(B, T, H, D).transpose(1, 2)
            k = k.view(B, T, 1, D).transpose(1, 2)
            v = v.view(B, T, 1, D).transpose(1, 2)
        elif self.grouped:  # rows in groups: per kv head, its q heads, k, v
            per = H // Hkv
            qkv = self.qkv(x).view(B, T, Hkv, per + 2, D)
            q = qkv[:, :, :, :per].reshape(B, T, H, D).transpose(1, 2)
            k = qkv[:, :, :, per].transpose(1, 2)
            v = qkv[:, :, :, per + 1].transpose(1, 2)
        else:
            q, k, v = self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
            k = k.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
            v = v.view(B, T, Hkv, D).transpose(1, 2)
        if self.qk_transform is not None:
            q, k = self.qk_transform(q, k)
        position = inputs.position
        q, k = position.rotate(q, k, inputs.positions)
        if self.q_multiplier is not None:
            q = q * self.q_multiplier
        mask = inputs.key_padding_mask
        docs = {}
        if inputs.document_ids is not None:
            if inputs.cache is not None:
                raise LlmkitError("attention: document_ids cannot be combined with a KV cache")
            docs["document_ids"] = inputs.document_ids
        if inputs.cache is not None:
            k, v, mask = inputs.cache.update(k, v, mask)
        elif mask is not None:
            mask = mask[:, -k.shape[2] :]
        bias = position.score_bias()
        if inputs.context is not None:  # the sequence split across ranks: ring attention
            if inputs.cache is not None or mask is not None or docs or bias is not None:
                raise LlmkitError(
                    "context-parallel attention takes whole causal rows: no KV cache, padding "
                    "mask, document mask or score bias"
                )
            y = inputs.context.attention(q, k, v, inputs.positions)
            return self.out_proj(y.transpose(1, 2).reshape(B, T, H * D))
        split = self.grouped or self.shared_kv_rows is not None
        if bias is not None and split:  # this rank's heads' slopes
            bias = DistanceBias(bias.slopes[self.head_offset : self.head_offset + H])
        y = self.kernel(q, k, v, causal=True, bias=bias, key_padding_mask=mask, **docs)
        y = y.transpose(1, 2).reshape(B, T, H * D)
        return self.out_proj(y)
