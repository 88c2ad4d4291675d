"""SwiGLU feed-forward block (Shazeer 2020, "GLU Variants Improve Transformer") whose gated
activation ``silu(gate) * up`` runs as the fused Triton kernel :mod:`llmkit.kernels.swiglu`.

Same options, parameters and state-dict keys as ``swiglu``, so weights are interchangeable.
The kernel runs when :func:`llmkit.kernels.runtime.use_triton` allows it (a CUDA tensor, or
``TRITON_INTERPRET=1``); otherwise the plain PyTorch activation runs, announced once.
"""

from __future__ import annotations

from torch import Tensor

from llmkit.components.ffn.swiglu import SwiGLU
from llmkit.kernels import runtime

#: Component name used in runtime notices.
NAME = "ffn.swiglu_triton"


class SwiGLUTriton(SwiGLU):
    """``out_proj(silu(gate_proj(x)) * up_proj(x))`` with a fused Triton activation
    (Shazeer 2020)."""

    def activate(self, gate: Tensor, up: Tensor) -> Tensor:
        if runtime.use_triton(gate, up):
            # Imported lazily: only calls that run the kernel load it.
            from llmkit.kernels import swiglu as kernel

            if kernel.supported(gate, up):
                return kernel.swiglu_triton(gate, up)
        else:
            runtime.announce_reference(NAME)
        return super().activate(gate, up)

    @classmethod
    def runtime_backend(cls) -> str:
        """Which path this component takes on this machine (``llmkit show``)."""
        return runtime.describe_backend(NAME)
