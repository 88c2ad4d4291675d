"""Int8 linear layers and the tied embedding that reads their table (what
:mod:`llmkit.inference.quantize` converts a model to; its docstring says which one where).

- :class:`Int8Linear`: int8 weights as buffers, ``(x @ q.T) · scale`` in the activation's
  dtype, or ``aten._weight_int8pack_mm`` in bf16 on a CPU with native bf16 (any device).
- :class:`DynamicInt8Linear`: fbgemm's packed int8 weight and its dynamically quantized
  linear (w8a8, x86 CPUs).
- :class:`Int8DigitsLinear`: fbgemm's packed int8 weight, each activation row as two 7-bit
  digits through one int8 product (weight-only grade, x86 CPUs).

The private operators are probed once before use (:func:`int8_mm_available`,
:func:`dynamic_available`, :func:`digits_available`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: Bytes fbgemm keeps per output channel of a packed int8 weight (fp32 scale, int32 zero
#: point, int32 column offset).
PACKED_BYTES_PER_CHANNEL = 12


def _symmetric_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row symmetric int8: values (out, in) and fp32 scales (out,), w ≈ q · scale."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


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
        self.bf16_products = False

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        q, scale = _symmetric_int8(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale, bias)

    def dequantized(self) -> Tensor:
        return self.weight.float() * self.scale[:, None]

    def int8_weight(self) -> tuple[Tensor, Tensor]:
        """The int8 values (out, in) and fp32 scales (out,)."""
        return self.weight, self.scale

    def use_bf16_products(self) -> bool:
        """On a CPU with native bf16: multiply with ``aten._weight_int8pack_mm`` (the int8
        weight read as is, the activation and the per-channel scale in bf16, the result
        back in ``x``'s dtype) where this PyTorch has it and ``in_features`` is a multiple
        of :data:`INT8_MM_ALIGN` (its CPU kernel returns garbage otherwise). Returns
        whether it does; :func:`quantize_model` calls it where the CPU has native bf16."""
        self.bf16_products = (
            self.weight.device.type == "cpu"
            and self.in_features % INT8_MM_ALIGN == 0
            and int8_mm_available()
        )
        return self.bf16_products

    def forward(self, x: Tensor) -> Tensor:
        if self.bf16_products and x.device.type == "cpu" and no_grad_to(x):
            x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
            scale = self.scale.to(torch.bfloat16)
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, scale).to(x.dtype)
            y = y.view(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def weight_nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * self.scale.element_size()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def no_grad_to(x: Tensor) -> bool:
    """Whether no gradient flows back to ``x`` (the fast CPU products have no backward)."""
    return not (x.requires_grad and torch.is_grad_enabled())


#: ``aten._weight_int8pack_mm`` on a CPU needs the inner dimension a multiple of this.
INT8_MM_ALIGN = 32


@functools.cache
def int8_mm_available() -> bool:
    """Whether this PyTorch has ``aten._weight_int8pack_mm`` on the CPU and it gives the
    dequantized product (checked once on a small one)."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randint(-127, 128, (24, 2 * INT8_MM_ALIGN), generator=g, dtype=torch.int8)
        scale = torch.rand(24, generator=g).bfloat16()
        x = torch.randn(3, 2 * INT8_MM_ALIGN, generator=g).bfloat16()
        got = torch.ops.aten._weight_int8pack_mm(x, w, scale).float()
        want = F.linear(x.float(), w.float() * scale.float()[:, None])
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class DynamicInt8Linear(nn.Module):
    """fbgemm's dynamically quantized linear (w8a8-dynamic, CPU): int8 per-channel weights
    packed for fbgemm; each call quantizes ``x`` per tensor to 7 bits and multiplies in int8.

    Built from the same symmetric int8 values as :class:`Int8Linear`; the output has the
    input's dtype (the product itself is fp32)."""

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.has_bias = bias is not None
        self._pack(weight, scale, bias)

    def _pack(self, weight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        with quiet():
            zeros = torch.zeros(weight.shape[0], dtype=torch.long)
            qweight = torch._make_per_channel_quantized_tensor(
                weight.cpu(), scale.cpu().double(), zeros, 0
            )
            b = None if bias is None else bias.detach().cpu().float().contiguous()
            self._packed = torch.ops.quantized.linear_prepack(qweight, b)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> DynamicInt8Linear:
        q, scale = _symmetric_int8(linear.weight)
        return cls(q, scale, None if linear.bias is None else linear.bias.detach())

    def int8_weight(self) -> tuple[Tensor, Tensor]:
        """The int8 values (out, in) and fp32 scales (out,), unpacked (a copy)."""
        with quiet():
            w, _ = self._packed.unpack()
            return w.int_repr(), w.q_per_channel_scales().float()

    def dequantized(self) -> Tensor:
        """The fp32 weight the int8 values stand for (out, in), as :class:`Int8Linear`'s."""
        w, scale = self.int8_weight()
        return w.float() * scale[:, None]

    def _packed_bias(self) -> Tensor | None:
        with quiet():
            return self._packed.unpack()[1]

    # The packed weight is opaque to PyTorch: the state dict holds it as Int8Linear does,
    # ``weight`` (int8) and ``scale`` (fp32), and the bias fbgemm keeps as ``bias``.
    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"], destination[prefix + "scale"] = self.int8_weight()
        if self.has_bias:
            destination[prefix + "bias"] = self._packed_bias()

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        names = ["weight", "scale"] + (["bias"] if self.has_bias else [])
        keys = [prefix + name for name in names]
        shapes = [(self.out_features, self.in_features), (self.out_features,), (self.out_features,)]
        found = [state_dict.get(k) for k in keys]
        for key, value, shape in zip(keys, found, shapes, strict=False):
            if value is None:
                missing_keys.append(key)
            elif tuple(value.shape) != shape:
                errors.append(f"size mismatch for {key}: {tuple(value.shape)} here {shape}")
            elif key.endswith("weight") and value.dtype != torch.int8:
                errors.append(f"{key} is {value.dtype}; an int8 layer loads int8 values")
        if all(v is not None for v in found) and len(errors) == 0:
            weight, scale = found[0].to(torch.int8), found[1].float()
            self._pack(weight, scale, found[2] if self.has_bias else None)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )
        mine = set(keys)
        unexpected_keys[:] = [k for k in unexpected_keys if k not in mine]

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.quantized.linear_dynamic(x.float(), self._packed, True)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def weight_nbytes(self) -> int:
        n = self.out_features * (self.in_features + PACKED_BYTES_PER_CHANNEL)
        return n + (4 * self.out_features if self.has_bias else 0)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            "int8 w8a8-dynamic (fbgemm)"
        )


#: :class:`Int8DigitsLinear`: each activation row is scaled to ±DIGIT (7-bit values around
#: the zero point DIGIT + 1, the range fbgemm's AVX2 kernels add in pairs without
#: saturating); its rounding error, times LOW_DIGIT_SCALE, is the second digit.
DIGIT = 63
LOW_DIGIT_SCALE = 2 * DIGIT
#: Rows whose largest magnitude is below this are scaled as if it were this.
_SMALLEST_ROW = DIGIT * torch.finfo(torch.float32).tiny


class Int8DigitsLinear(DynamicInt8Linear):
    """int8 weight-only on fbgemm's int8 product (x86 CPUs): per-channel int8 weights packed
    for fbgemm, and each activation row carried as *two* 7-bit digits, so that the product
    runs in int8 at w8a8's speed while the activation keeps about 14 bits.

    A row x with largest magnitude m becomes u = x · 63/m; its high digit is round(u), its
    low digit round(126·(u − round(u))). Both go through one fbgemm call as rows of the
    same input (at one or eight rows the call costs what one row does: the weight is read
    once), and y = (W·hi + W·lo/126) · m/63 + bias. The activation's error is at most
    m/(2·63·126) ≈ m/15,900 per element, below bf16's rounding of every element larger
    than m/30 (bf16 keeps 8 significant bits); the w8a8 backend's is m/127.
    """

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        super().__init__(weight, scale, None)  # the bias is added after the digits meet
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), False)

    def forward(self, x: Tensor) -> Tensor:
        if not no_grad_to(x):  # fbgemm's product has no backward: the dequantized weight
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.dequantized().to(x.dtype), bias)
        x2 = x.reshape(-1, self.in_features).float()
        rows = x2.shape[0]
        # A digit's unit in x's units, per row: m/DIGIT (at least the smallest normal float).
        unit = x2.abs().amax(1, keepdim=True).clamp_(min=_SMALLEST_ROW).mul_(1 / DIGIT)
        digits = torch.empty(2, rows, self.in_features)
        u = torch.div(x2, unit, out=digits[1])
        hi = torch.round(u, out=digits[0])
        u.sub_(hi).mul_(LOW_DIGIT_SCALE)  # the low digit, rounded by fbgemm
        out = _DIGITS_PRODUCT(digits.view(2 * rows, self.in_features), 1.0, DIGIT + 1, self._packed)
        y = torch.add(out[:rows], out[rows:], alpha=1.0 / LOW_DIGIT_SCALE)
        y = y.mul_(unit) if self.bias is None else torch.addcmul(self.bias, y, unit)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def weight_nbytes(self) -> int:
        return self.out_features * (self.in_features + PACKED_BYTES_PER_CHANNEL)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            "int8 weight-only (fbgemm, two-digit activations)"
        )


#: fbgemm's int8 linear on a float input quantized with a given scale and zero point,
#: dequantized to fp32 (the product of :class:`Int8DigitsLinear`).
_DIGITS_PRODUCT = getattr(
    torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32", None
)


@functools.cache
def digits_available() -> bool:
    """Whether fbgemm's int8 linear with a given input scale works here (x86 CPU builds)
    and :class:`Int8DigitsLinear` gives the dequantized product (checked once on a small
    one: 1e-3 of the largest output, where the two digits give about 1e-4)."""
    if _DIGITS_PRODUCT is None:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        lin = nn.Linear(40, 24)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(24, 40, generator=g))
            lin.bias.copy_(torch.randn(24, generator=g))
        layer = Int8DigitsLinear.from_float(lin)
        x = torch.randn(3, 40, generator=g)
        got = layer(x)
        want = F.linear(x, layer.dequantized(), lin.bias.detach())
        return bool((got - want).abs().max() <= 1e-3 * want.abs().max())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class Int8Embedding(nn.Module):
    """A token embedding looked up in an int8 table with one scale per row (the int8 table
    of a tied output head): ``weight[idx] · scale[idx]`` in ``dtype``."""

    def __init__(self, weight: Tensor, scale: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)

    def forward(self, idx: Tensor) -> Tensor:
        rows = F.embedding(idx, self.weight).to(self.dtype)
        return rows * self.scale[idx].unsqueeze(-1).to(self.dtype)


@contextmanager
def quiet() -> Iterator[None]:
    """Silences the deprecation warnings of PyTorch's quantized-tensor helpers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


@functools.cache
def dynamic_available() -> bool:
    """Whether fbgemm's dynamically quantized linear works here (x86 CPU builds)."""
    try:
        DynamicInt8Linear.from_float(nn.Linear(8, 4))(torch.zeros(1, 8))
        return True
    except Exception:
        return False
