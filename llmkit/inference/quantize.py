"""Int8 weight quantization of a trained model for inference.

Every ``nn.Linear`` inside the blocks (attention projections, feed-forward layers, whatever a
component builds from ``nn.Linear``) gets int8 weights with one scale per output channel
(symmetric, per-channel). Token and position embeddings, norms and any parameter that is not
an ``nn.Linear`` weight stay in their original precision. The output head is quantized when
it has its own weight; a head tied to the token embedding stays tied and unquantized by
default (quantizing it would add an int8 copy of the embedding next to the fp32 table the
lookup still needs), ``head=True`` quantizes it anyway.

Two backends:

- ``dynamic`` (CPU): PyTorch's dynamically quantized linear
  (``torch.ao.nn.quantized.dynamic.Linear``, fbgemm/onednn kernels): activations are
  quantized to int8 per call too, and the matrix product runs in int8 — smaller *and*
  usually faster than fp32 on x86 CPUs. ``torch.ao.quantization`` is deprecated in favour of
  torchao; where it is missing the ``weight_only`` backend is used.
- ``weight_only`` (any device): :class:`Int8Linear` keeps int8 weights and computes
  ``(x @ q.T) * scale`` in the activation dtype — the memory saving without int8 kernels.

``auto`` picks ``dynamic`` for a CPU model when available, else ``weight_only``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

METHODS = ("int8",)
BACKENDS = ("auto", "dynamic", "weight_only")


class Int8Linear(nn.Module):
    """A linear layer with per-output-channel symmetric int8 weights (weight-only).

    ``weight`` (out, in) int8 and ``scale`` (out,) fp32 with ``W ≈ weight · scale[:, None]``;
    the product is ``(x @ weight.T) · scale + bias`` in the input's dtype.
    """

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        w = linear.weight.detach().float().contiguous()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale, bias)

    def dequantized(self) -> Tensor:
        return self.weight.float() * self.scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def weight_nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * self.scale.element_size()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def dynamic_available() -> bool:
    """Whether PyTorch's dynamically quantized linear works here (CPU, fbgemm/onednn)."""
    try:
        with _quiet():
            import torch.ao.nn.quantized.dynamic as nnqd
            from torch.ao.quantization import per_channel_dynamic_qconfig

            lin = nn.Linear(8, 4)
            lin.qconfig = per_channel_dynamic_qconfig
            nnqd.Linear.from_float(lin)(torch.zeros(1, 8))
        return True
    except Exception:
        return False


def _dynamic_linear(linear: nn.Linear) -> nn.Module:
    with _quiet():
        import torch.ao.nn.quantized.dynamic as nnqd
        from torch.ao.quantization import per_channel_dynamic_qconfig

        src = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        src.weight = nn.Parameter(linear.weight.detach().float().contiguous().clone())
        if linear.bias is not None:
            src.bias = nn.Parameter(linear.bias.detach().float().clone())
        src.qconfig = per_channel_dynamic_qconfig
        return nnqd.Linear.from_float(src)


def _is_dynamic(mod: nn.Module) -> bool:
    return type(mod).__module__.startswith("torch.ao.nn.quantized.dynamic")


@dataclass
class QuantizeReport:
    backend: str
    linears: int  # linear layers quantized
    params: int  # their weight parameters


def quantize_model(
    model: nn.Module,
    method: str = "int8",
    *,
    backend: str = "auto",
    head: bool | None = None,
    inplace: bool = False,
) -> nn.Module:
    """A copy of ``model`` (unless ``inplace``) with int8 linear weights (see the module
    docstring). ``head=None`` quantizes an untied output head only. The result is for
    inference: ``.eval()``, no gradients. ``model.quantization`` records what was done."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose from {', '.join(METHODS)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if backend == "auto":
        backend = "dynamic" if device.type == "cpu" and dynamic_available() else "weight_only"
    elif backend == "dynamic" and device.type != "cpu":
        raise ValueError("the dynamic int8 backend runs on CPU only; use weight_only")
    elif backend == "dynamic" and not dynamic_available():
        raise ValueError("this PyTorch has no dynamic int8 linear; use weight_only")
    if not inplace:
        shared = {
            id(v): v for k in ("spec", "config") if (v := getattr(model, k, None)) is not None
        }
        model = copy.deepcopy(model, memo=shared)  # the (immutable) spec is shared
    model.eval()
    tok_emb = getattr(model, "tok_emb", None)
    tied_weight = tok_emb.weight if isinstance(tok_emb, nn.Embedding) else None
    targets: list[tuple[nn.Module, str, nn.Linear]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is not nn.Linear:
                continue
            is_head = parent is model and name == "lm_head"
            tied = tied_weight is not None and child.weight is tied_weight
            if is_head and not (head if head is not None else not tied):
                continue
            targets.append((parent, name, child))
    params = 0
    for parent, name, child in targets:
        params += child.weight.numel()
        if backend == "dynamic":
            new: nn.Module = _dynamic_linear(child)
        else:
            new = Int8Linear.from_float(child).to(child.weight.device)
        setattr(parent, name, new)
    for p in model.parameters():
        p.requires_grad_(False)
    model.quantization = QuantizeReport(backend, len(targets), params)  # type: ignore[assignment]
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: unique parameters, plus the int8 weights,
    scales and zero points of quantized linear layers (buffers such as rotary tables,
    which are recomputed rather than loaded, are not counted)."""
    total = 0
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for mod in model.modules():
        if isinstance(mod, Int8Linear):
            total += mod.weight_nbytes()
        elif _is_dynamic(mod):
            with _quiet():
                w, b = mod._packed_params._weight_bias()
            total += w.numel()  # int8
            if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
                for t in (w.q_per_channel_scales(), w.q_per_channel_zero_points()):
                    total += t.numel() * t.element_size()
            else:
                total += 8 + 8
            if b is not None:
                total += b.numel() * b.element_size()
    return total
