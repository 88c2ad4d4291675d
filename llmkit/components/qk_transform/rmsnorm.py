"""QK-norm with RMSNorm per head (Dehghani et al. 2023 introduced QK-norm; OLMo 2, Qwen3 and
Gemma 3 use this form): q and k are each RMS-normalized over the head dimension with a gain
per dimension shared by all heads, before a rotary scheme rotates them.

Two ``rmsnorm`` norm components over ``head_dim`` (``q_norm``, ``k_norm``), so the gain
offset (Gemma 3's 1 + w) and the fp32 computation are the norm's own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import Tensor

from llmkit.components.norm.options import RMSNormOptions
from llmkit.components.norm.rmsnorm import RMSNorm
from llmkit.components.qk_transform.options import QKRMSNormOptions
from llmkit.contracts import BuildContext, QKTransform


class QKRMSNorm(QKTransform):
    """``q_norm(q)``, ``k_norm(k)``: RMSNorm over D of q (B, Hq, T, D) and k (B, Hkv, T, D)."""

    Options = QKRMSNormOptions

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: per-head norms, whole weights, on the rank's heads."""
        from llmkit.parallel.tensor import HeadShards

        return {"": HeadShards()}

    def __init__(self, options: QKRMSNormOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        norm = RMSNormOptions(eps=options.eps, offset=options.offset)
        per_head = replace(ctx, dim=ctx.head_dim)
        self.q_norm = RMSNorm(norm, per_head)
        self.k_norm = RMSNorm(norm, per_head)

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return self.q_norm(q), self.k_norm(k)
