"""Low-precision weights for inference: int8 (two backends) and bf16.

**int8.** Every ``nn.Linear`` of the model (attention projections, feed-forward layers,
whatever a component builds from ``nn.Linear``) and the output head get int8 weights with
one scale per output channel (symmetric, round to nearest, ``|q| ≤ 127``). The head is the
largest matrix a decoding step reads (GPT-2 small: 38.6 M of its 124 M weights), so it is
quantized too. A head tied to the token embedding stays tied: the embedding looks its rows
up in the head's int8 table (:class:`Int8Embedding`), so no fp32 table is kept (a head
packed for fbgemm, ``dynamic`` or ``weight_only``'s :class:`Int8DigitsLinear`, comes with a
plain int8 copy for the lookup; :class:`Int8Linear` shares one table). Position
embeddings, norms and biases keep their precision; ``head=False`` leaves the head (and a
tied embedding) as it was. Two backends:

- ``dynamic`` (CPU, "w8a8-dynamic"): :class:`DynamicInt8Linear`, fbgemm's dynamically
  quantized linear. The *activations* are quantized too, per call, per tensor (7-bit,
  ``reduce_range``, which fbgemm's AVX2 kernels need), and the product runs in int8: not
  weight-only, but 1.6–10× faster than fp32 per product on an AVX2 CPU (the fastest
  decode here). Packing uses the ``torch.ops.quantized`` operators directly, not the
  deprecated ``torch.ao.quantization`` workflow.
- ``weight_only`` (any device): the activations are not quantized to 7 bits. On an x86 CPU
  with fbgemm, layers of at least :data:`DIGITS_MIN_WEIGHTS` weights become
  :class:`Int8DigitsLinear` (CPU only): fbgemm's int8 product, each activation row carried
  as two 7-bit digits (about 14 bits, finer than bf16 for every element above 1/30 of the
  row's largest; a row with a large outlier loses more), at nearly w8a8's speed: 2.80–2.97×
  transformers' fp32 decode at batch 1 and 8 on a 2-core EPYC (docs/benchmarks.md).
  Elsewhere :class:`Int8Linear` keeps int8 weights and computes ``(x @ q.T) · scale`` in the
  activation's dtype; on a CPU with native bf16 (AVX512-BF16 or AMX) in
  ``aten._weight_int8pack_mm`` with the activation in bf16, which reads the int8 weight as
  is. Without either it is no faster than fp32: PyTorch has no fast int8-weight
  fp32-activation kernel on AVX2 CPUs (``_weight_int8pack_mm`` with fp32 activations
  streams 1 GB/s).

``auto`` picks ``dynamic`` for a CPU model where fbgemm works, else ``weight_only``.

**bf16.** :class:`BF16Linear` stores bf16 weights (half the bytes) and multiplies in bf16;
the residual stream, norms and logits stay in the model's dtype. On a CPU with native bf16
the weights are packed in oneDNN's layout (:meth:`BF16Linear.pack`), 1.5–2.2× as fast
there as ``F.linear`` on plain bf16 weights. Fast only where the hardware multiplies bf16
natively (CUDA, AVX512-BF16 or AMX CPUs); on an AVX2 CPU bf16 products are emulated and far
slower than fp32. A tied head shares its bf16 table with the embedding, unless the head is
packed: the embedding then keeps the plain table. ``method="auto"`` (:func:`choose_method`)
picks int8 on a CPU with fbgemm (faster than bf16 for decoding even where the CPU has
AVX512-BF16), bf16 on a CUDA GPU that has it.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: ``int8-weight-only`` is ``int8`` with ``backend="weight_only"`` (one name for the CLI,
#: whose ``--quantize`` offers these: ``llmkit.cli.common.QUANTIZE``).
METHODS = ("int8", "int8-weight-only", "bf16", "auto")
BACKENDS = ("auto", "dynamic", "weight_only")
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
        if self.bf16_products and x.device.type == "cpu" and _no_grad_to(x):
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


def _no_grad_to(x: Tensor) -> bool:
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
        with _quiet():
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
        with _quiet():
            w, _ = self._packed.unpack()
            return w.int_repr(), w.q_per_channel_scales().float()

    def _packed_bias(self) -> Tensor | None:
        with _quiet():
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
#: ``weight_only`` on a CPU: layers with fewer weights keep :class:`Int8Linear`. The two
#: digits cost about 70 µs a call at any size (a dozen small ops of 4–5 µs and fbgemm's
#: call), Int8Linear's plain product about 15 µs at 64×64. One row, weights streamed from
#: memory (2-core EPYC), digits against plain: 512×512 93 / 63 µs, 768×768 125 / 109,
#: 512×2048 131 / 182, 768×3072 197 / 344 (fp32 764).
DIGITS_MIN_WEIGHTS = 1 << 19
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
        if not _no_grad_to(x):  # fbgemm's product has no backward: the dequantized weight
            w, scale = self.int8_weight()
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, (w.float() * scale[:, None]).to(x.dtype), bias)
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
        w, scale = layer.int8_weight()
        want = F.linear(x, w.float() * scale[:, None], lin.bias.detach())
        return bool((got - want).abs().max() <= 1e-3 * want.abs().max())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class BF16Linear(nn.Module):
    """A linear layer with bf16 weights: ``x`` is cast to bf16 for the product and the
    result back to ``x``'s dtype; the bias is added in that dtype.

    :meth:`pack` (which :func:`quantize_model` calls on a CPU with native bf16) replaces the
    weight by oneDNN's packed (blocked) form of it, the same numbers in the layout its bf16
    matrix kernels read; there the product runs through ``mkldnn._linear_pointwise``. On a
    2-core EPYC with AVX512-BF16 that streamed 13–16 GB/s of weights at batch 1 against
    6.6–8.7 GB/s for ``F.linear`` on the plain bf16 weight (docs/benchmarks.md). The packed
    weight is opaque: ``state_dict`` saves it plain, ``deepcopy`` and ``.to()`` unpack
    and pack again, :meth:`dense_weight` gives the plain tensor."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> BF16Linear:
        return cls(linear.weight, None if linear.bias is None else linear.bias.clone())

    @property
    def packed(self) -> bool:
        """Whether the weight is held in oneDNN's packed form."""
        return bool(self.weight.is_mkldnn)

    def pack(self) -> bool:
        """Hold the weight in oneDNN's packed form if it is a bf16 CPU tensor and packing
        works in this PyTorch (:func:`bf16_packing_available`); returns whether it is."""
        w = self.weight
        if self.packed:
            return True
        if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not bf16_packing_available():
            return False
        self.weight = _pack_bf16(w)
        return True

    def dense_weight(self) -> Tensor:
        """The weight as a plain (out, in) bf16 tensor (a copy when packed)."""
        return self.weight.to_dense() if self.packed else self.weight

    def forward(self, x: Tensor) -> Tensor:
        if self.packed and _no_grad_to(x):
            y = _packed_linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        elif self.packed:  # oneDNN's packed product has no backward
            y = F.linear(x.to(torch.bfloat16), self.weight.to_dense()).to(x.dtype)
        else:
            y = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed:
            destination[prefix + "weight"] = self.weight.to_dense()

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        packed = self.packed
        if packed:
            self.weight = self.weight.to_dense()
        super()._load_from_state_dict(*args, **kwargs)
        if packed:
            self.pack()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        packed = self.packed
        if packed:
            self.weight = self.weight.to_dense()
        out = super()._apply(fn, recurse)
        if packed:
            self.pack()
        return out

    def __getstate__(self) -> dict[str, Any]:
        """For ``copy.deepcopy`` and pickling: a packed weight as its plain tensor (opaque
        tensors have no storage to copy), packed again by :meth:`__setstate__`."""
        state = dict(super().__getstate__())
        if self.packed:
            state["_buffers"] = {**state["_buffers"], "weight": self.weight.to_dense()}
            state["_repack"] = True
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        repack = state.pop("_repack", False)
        super().__setstate__(state)
        if repack:
            self.pack()

    def extra_repr(self) -> str:
        packed = ", packed (oneDNN)" if self.packed else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16{packed}"


def _pack_bf16(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def _packed_linear(x: Tensor, packed: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@functools.cache
def bf16_packing_available() -> bool:
    """Whether this PyTorch can pack a bf16 weight for oneDNN on the CPU and multiply with
    it, giving what ``F.linear`` gives (checked once on a small product)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=g).bfloat16()
        x = torch.randn(3, 40, generator=g).bfloat16()
        with torch.no_grad():
            got, want = _packed_linear(x, _pack_bf16(w)).float(), F.linear(x, w).float()
        return bool(torch.allclose(got, want, rtol=1e-2, atol=1e-2))
    except (AttributeError, RuntimeError):
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


class LowPrecisionEmbedding(nn.Module):
    """A token embedding looked up in a bf16 table (a tied head's), returned in ``dtype``."""

    def __init__(self, weight: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.register_buffer("weight", weight)

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.weight).to(self.dtype)


#: Modules that only look rows up: a decoding step reads a few rows of them, not all.
LOOKUPS = (nn.Embedding, Int8Embedding, LowPrecisionEmbedding)


@contextmanager
def _quiet() -> Iterator[None]:
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


def choose_method(device: torch.device | str = "cpu", backend: str = "auto") -> str:
    """``auto``: on a CPU, int8 where fbgemm's int8 product serves ``backend`` (its dynamic
    linear for ``auto`` and ``dynamic``, :class:`Int8DigitsLinear` for ``weight_only``: the
    fastest decodes measured on every CPU here, AVX512-BF16 ones included), else bf16 where
    the CPU multiplies it natively, else int8; on a CUDA GPU, bf16 where it has it, else
    int8.

    On a 2-core EPYC with AVX512-BF16 (docs/benchmarks.md), GPT-2 small greedy decode against
    transformers fp32: int8 3.81–3.87× at batch 1 and 3.87–4.94× at batch 8, packed bf16
    weights 1.70–1.81× and 3.11–3.28× (oneDNN's packed bf16 matrix–vector product streams
    10–15 GB/s of weights there, about fp32's rate)."""
    device = torch.device(device)
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "int8"
    fbgemm = dynamic_available() if backend in ("auto", "dynamic") else digits_available()
    if device.type == "cpu" and not fbgemm and _cpu_has_fast_bf16():
        return "bf16"
    return "int8"


def _cpu_has_fast_bf16() -> bool:
    from llmkit.hardware import cpu_has_fast_bf16

    return cpu_has_fast_bf16()


def _is_legacy_dynamic(mod: nn.Module) -> bool:
    return type(mod).__module__.startswith("torch.ao.nn.quantized.dynamic")


@dataclass
class QuantizeReport:
    backend: str  # dynamic, weight_only or bf16
    linears: int  # linear layers converted (the head included)
    params: int  # their weight parameters
    method: str = "int8"


def quantize_model(
    model: nn.Module,
    method: str = "int8",
    *,
    backend: str = "auto",
    head: bool | None = None,
    inplace: bool = False,
) -> nn.Module:
    """A copy of ``model`` (unless ``inplace``) with int8 or bf16 linear weights (see the
    module docstring); ``method="auto"`` resolves with :func:`choose_method`. The head is
    converted unless ``head=False``. The result is for inference: ``.eval()``, no
    gradients. ``model.quantization`` records what was done."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose from {', '.join(METHODS)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if method == "int8-weight-only":
        if backend == "dynamic":
            raise ValueError("int8-weight-only has no dynamic backend; use int8")
        method, backend = "int8", "weight_only"
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if method == "auto":
        method = choose_method(device, backend)
    if method == "bf16":
        backend = "bf16"
    elif backend == "auto":
        backend = "dynamic" if device.type == "cpu" and dynamic_available() else "weight_only"
    elif backend == "dynamic" and device.type != "cpu":
        raise ValueError("the dynamic int8 backend runs on CPU only; use weight_only")
    elif backend == "dynamic" and not dynamic_available():
        raise ValueError("this PyTorch has no fbgemm dynamic int8 linear; use weight_only")
    if not inplace:
        shared = {
            id(v): v for k in ("spec", "config") if (v := getattr(model, k, None)) is not None
        }
        model = copy.deepcopy(model, memo=shared)  # the (immutable) spec is shared
    model.eval()
    tok_emb = getattr(model, "tok_emb", None)
    tied_weight = tok_emb.weight if isinstance(tok_emb, nn.Embedding) else None
    targets: list[tuple[nn.Module, str, nn.Linear]] = []
    tied_head: nn.Linear | None = None
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is not nn.Linear:
                continue
            if parent is model and name == "lm_head":
                if head is False:
                    continue
                if tied_weight is not None and child.weight is tied_weight:
                    tied_head = child
            targets.append((parent, name, child))
    params = 0
    for parent, name, child in targets:
        params += child.weight.numel()
        new = _convert(child, backend)
        setattr(parent, name, new)
        if child is tied_head:  # the embedding looks up the head's table
            assert tok_emb is not None
            model.tok_emb = _tied_embedding(new, tok_emb.weight.dtype)
    if backend in ("bf16", "weight_only") and device.type == "cpu" and _cpu_has_fast_bf16():
        for mod in model.modules():  # after tying: a tied embedding keeps the plain table
            if isinstance(mod, BF16Linear):
                mod.pack()
            elif isinstance(mod, Int8Linear):
                mod.use_bf16_products()
    for p in model.parameters():
        p.requires_grad_(False)
    model.quantization = QuantizeReport(backend, len(targets), params, method)  # type: ignore[assignment]
    return model


def _convert(linear: nn.Linear, backend: str) -> nn.Module:
    if backend == "bf16":
        return BF16Linear.from_float(linear)
    if backend == "dynamic":
        return DynamicInt8Linear.from_float(linear)
    large = linear.weight.numel() >= DIGITS_MIN_WEIGHTS
    if linear.weight.device.type == "cpu" and large and digits_available():
        return Int8DigitsLinear.from_float(linear)
    return Int8Linear.from_float(linear).to(linear.weight.device)


def _tied_embedding(head: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The token embedding of a tied head: its own table (bf16, :class:`Int8Linear`) or an
    unpacked copy of fbgemm's int8 values (the same numbers)."""
    if isinstance(head, BF16Linear):
        return LowPrecisionEmbedding(head.weight, dtype)
    assert isinstance(head, Int8Linear | DynamicInt8Linear)
    weight, scale = head.int8_weight()
    return Int8Embedding(weight, scale, dtype)


def _weight_tensors(model: nn.Module) -> Iterator[tuple[nn.Module, int, int]]:
    """(module, tensor id, bytes) of every weight a module holds: parameters, the buffers
    of the quantized modules, and fbgemm's packed weights (one entry each)."""
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            yield mod, id(p), p.numel() * p.element_size()
        if isinstance(mod, Int8Linear | BF16Linear | Int8Embedding | LowPrecisionEmbedding):
            for b in mod.buffers(recurse=False):
                yield mod, id(b), b.numel() * b.element_size()
        elif isinstance(mod, DynamicInt8Linear):
            yield mod, id(mod), mod.weight_nbytes()
        elif _is_legacy_dynamic(mod):
            yield mod, id(mod), _legacy_dynamic_nbytes(mod)


def _legacy_dynamic_nbytes(mod: nn.Module) -> int:
    with _quiet():
        w, b = mod._packed_params._weight_bias()  # type: ignore[operator, union-attr]
    total = w.numel()
    if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        for t in (w.q_per_channel_scales(), w.q_per_channel_zero_points()):
            total += t.numel() * t.element_size()
    else:
        total += 8 + 8
    return total + (0 if b is None else b.numel() * b.element_size())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: unique parameters, plus the int8 or bf16
    weights and per-channel data of converted layers (buffers such as rotary tables, which
    are recomputed rather than loaded, are not counted)."""
    sizes = {key: n for _, key, n in _weight_tensors(model)}
    return sum(sizes.values())


def decode_read_bytes(model: nn.Module) -> int:
    """Weight bytes one decoding step reads: every weight counted by :func:`weight_bytes`
    except tables that are only looked up (token and position embeddings: a step reads a
    few rows of them). A tied fp32 head's table counts (the head reads all of it). The KV
    cache and activations are not included."""
    sizes: dict[int, int] = {}
    read: set[int] = set()
    for mod, key, n in _weight_tensors(model):
        sizes[key] = n
        if not isinstance(mod, LOOKUPS):
            read.add(key)
    return sum(sizes[k] for k in read)
