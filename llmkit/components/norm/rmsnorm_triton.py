"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization") as the fused
Triton kernel :mod:`llmkit.kernels.rmsnorm` (forward and backward, weight gradient included,
fp32 math).

Same options, parameter and state-dict key (``weight``) as ``rmsnorm``, so weights are
interchangeable. The kernel runs when :func:`llmkit.kernels.runtime.use_triton` allows it (a
CUDA tensor, or ``TRITON_INTERPRET=1``); otherwise the plain PyTorch ``rmsnorm`` computation
runs, announced once.
"""

from __future__ import annotations

from torch import Tensor

from llmkit.components.norm.rmsnorm import RMSNorm
from llmkit.kernels import runtime

#: Component name used in runtime notices.
NAME = "norm.rmsnorm_triton"


class RMSNormTriton(RMSNorm):
    """``x / sqrt(mean(x²) + eps) · (offset + weight)`` by a fused Triton kernel (Zhang &
    Sennrich 2019); fp32 math, output in the input dtype."""

    def forward(self, x: Tensor) -> Tensor:
        # A DTensor (sequence-parallel under tensor parallelism) runs the reference: the
        # kernel has no sharding rule.
        if not hasattr(x, "placements") and runtime.use_triton(x, self.weight):
            # Imported lazily: only calls that run the kernel load it.
            from llmkit.kernels import rmsnorm as kernel

            # 1 + w in fp32 (a bf16 weight cannot hold it exactly), as the reference computes
            gain = self.weight.float() + self.offset if self.offset else self.weight
            if kernel.supported(x, gain):
                return kernel.rms_norm_triton(x, gain, self.eps)
        else:
            runtime.announce_reference(NAME)
        return super().forward(x)

    @classmethod
    def runtime_backend(cls) -> str:
        """Which path this component takes on this machine (``llmkit show``)."""
        return runtime.describe_backend(NAME)
