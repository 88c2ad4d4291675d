"""Two-layer position-wise MLP with a selectable activation.

The Transformer feed-forward block (Vaswani et al. 2017), GELU as in GPT-2 (Hendrycks &
Gimpel 2016; ``gelu_tanh`` is GPT-2's tanh approximation), squared ReLU from Primer
(So et al. 2021), SiLU (Elfwing et al. 2018).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from llmkit.components.ffn.options import Activation as Activation
from llmkit.components.ffn.options import MLPOptions
from llmkit.contracts import BuildContext


class _ReLU2(torch.autograd.Function):
    """Squared ReLU, y = max(x, 0)², with the backward dx = 2·max(x, 0)·g from the saved
    max(x, 0): two ops each way, where autograd through relu-then-square records five
    backward ops over the hidden activations (pow's backward alone is a copy and two
    multiplies), the largest elementwise cost of a small ReLU² model's step."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        r = x.clamp_min(0)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (r,) = ctx.saved_tensors
        return torch.mul(grad, r).mul_(2.0)


def _relu2(x: Tensor) -> Tensor:
    return _ReLU2.apply(x)


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "relu": F.relu,
    "relu2": _relu2,
    "silu": F.silu,
}


class MLP(nn.Module):
    """``out_proj(act(in_proj(x)))`` (Vaswani et al. 2017; GPT-2 uses GELU and 4·d_model)."""

    Options = MLPOptions

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: the hidden units split (Megatron-LM)."""
        from llmkit.parallel.tensor import check_divides, column, row

        check_divides("the mlp's hidden size", self.in_proj.out_features, tp)
        return {"in_proj": column(), "out_proj": row()}

    def __init__(self, options: MLPOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        d = ctx.features
        hidden = options.hidden_size(d)
        bias = options.has_bias(ctx.bias)
        self.in_proj = nn.Linear(d, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, d, bias=bias)
        self.act = ACTIVATIONS[options.activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.out_proj(self.act(self.in_proj(x)))

    def extra_repr(self) -> str:
        return f"activation={self.options.activation}"
