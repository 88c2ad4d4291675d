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

**bf16.** :class:`BF16Linear` stores bf16 weights (half fp32's bytes, unless also packed,
below) and multiplies in bf16; the residual stream, norms and logits stay in the model's
dtype. One row (batch-1 decoding) on a CPU runs ATen's bf16 matrix-vector kernel on the
plain weight; on a CPU with native bf16 the layers also hold oneDNN's packed copy of their
weight for several rows (:meth:`BF16Linear.pack`: twice the weight bytes, 1.4–1.8× as fast
there as ``F.linear`` on plain bf16 weights). Fast only where the hardware multiplies bf16
natively (CUDA, AVX512-BF16 or AMX CPUs); on an AVX2 CPU bf16 products of several rows are
emulated and far slower than fp32. A tied head shares its bf16 table with the embedding.
``method="auto"`` (:func:`choose_method`) picks int8 on a CPU with fbgemm (faster than bf16
for decoding even where the CPU has AVX512-BF16), bf16 on a CUDA GPU that has it.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.inference.int8_linear import (
    INT8_MM_ALIGN,
    PACKED_BYTES_PER_CHANNEL,
    DynamicInt8Linear,
    Int8DigitsLinear,
    Int8Embedding,
    Int8Linear,
    digits_available,
    dynamic_available,
    int8_mm_available,
    no_grad_to,
    quiet,
)

__all__ = [
    "BACKENDS",
    "DIGITS_MIN_WEIGHTS",
    "INT8_MM_ALIGN",
    "LOOKUPS",
    "METHODS",
    "PACKED_BYTES_PER_CHANNEL",
    "BF16Linear",
    "DynamicInt8Linear",
    "Int8DigitsLinear",
    "Int8Embedding",
    "Int8Linear",
    "LowPrecisionEmbedding",
    "QuantizeReport",
    "bf16_packing_available",
    "choose_method",
    "decode_read_bytes",
    "digits_available",
    "dynamic_available",
    "int8_mm_available",
    "quantize_model",
    "weight_bytes",
]

#: ``int8-weight-only`` is ``int8`` with ``backend="weight_only"`` (one name for the CLI,
#: whose ``--quantize`` offers these: ``llmkit.cli.common.QUANTIZE``).
METHODS = ("int8", "int8-weight-only", "bf16", "auto")
BACKENDS = ("auto", "dynamic", "weight_only")
#: ``weight_only`` on a CPU: layers with fewer weights keep :class:`Int8Linear`. The two
#: digits cost about 70 µs a call at any size (a dozen small ops of 4–5 µs and fbgemm's
#: call), Int8Linear's plain product about 15 µs at 64×64. One row, weights streamed from
#: memory (2-core EPYC), digits against plain: 512×512 93 / 63 µs, 768×768 125 / 109,
#: 512×2048 131 / 182, 768×3072 197 / 344 (fp32 764).
DIGITS_MIN_WEIGHTS = 1 << 19


class BF16Linear(nn.Module):
    """A linear layer with bf16 weights: ``x`` is cast to bf16 for the product and the
    result back to ``x``'s dtype; the bias is added in that dtype.

    **One row** (a batch-1 decoding step) on a CPU runs ATen's own bf16 matrix-vector
    kernel on the plain weight (fp32 accumulation), with oneDNN switched off for the call
    (``torch.backends.mkldnn.enabled``; oneDNN's products read the weight at two thirds of
    its speed there). On a 2-core EPYC with AVX512-BF16 the 49 products of a GPT-2 small
    step (the head's included) took 13.6 ms against 18.6 ms packed; the 48 of the layers
    9.7 ms against 13.3 ms packed and 20.5 ms on the plain weight through oneDNN.

    **Several rows.** :meth:`pack` (which :func:`quantize_model` calls on a CPU with native
    bf16) adds oneDNN's packed (blocked) copy of the weight, :attr:`packed_weight`, which
    its bf16 matrix kernels read 1.4–1.8× as fast as the plain weight at 2 to 8 rows; the
    plain weight stays for one row, gradients, ``state_dict`` and a tied embedding, so a
    packed layer holds its weight twice. The packed copy is opaque: ``deepcopy``,
    pickling, ``.to()`` and ``load_state_dict`` pack again from the plain weight, and so
    does a product after the plain weight was written or replaced (for a weight made under
    ``torch.inference_mode``, which counts no writes, replaced only). Casting the layer to
    another float dtype (``.float()``, ``.half()``) is not supported: it stores bf16."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.packed_weight: Tensor | None = None
        self._packed_of: tuple[int, int] | None = None  # the weight's _stamp when packed

    @classmethod
    def from_float(cls, linear: nn.Linear) -> BF16Linear:
        return cls(linear.weight, None if linear.bias is None else linear.bias.clone())

    @property
    def packed(self) -> bool:
        """Whether the layer holds oneDNN's packed copy of its weight."""
        return self.packed_weight is not None

    def pack(self) -> bool:
        """Add oneDNN's packed copy of the weight if it is a bf16 CPU tensor and packing
        works in this PyTorch (:func:`bf16_packing_available`); returns whether it did."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not bf16_packing_available():
            self.packed_weight = self._packed_of = None
            return False
        self.packed_weight, self._packed_of = _pack_bf16(w), _stamp(w)
        return True

    def _fresh_packed(self) -> Tensor:
        """The packed copy, packed again if the plain weight was written or replaced."""
        w = self.weight
        if self._packed_of != _stamp(w):
            self.pack()
        assert self.packed_weight is not None
        return self.packed_weight

    def forward(self, x: Tensor) -> Tensor:
        xb = x.to(torch.bfloat16)
        if not no_grad_to(x):  # the fast products have no backward
            y = F.linear(xb, self.weight)
        elif x.numel() == self.in_features and x.device.type == "cpu":
            y = one_row_bf16_product(xb, self.weight)
        elif self.packed_weight is not None:
            y = _packed_linear(xb, self._fresh_packed())
        else:
            y = F.linear(xb, self.weight)
        if self.bias is None:
            return y.to(x.dtype)
        bias = self.bias if self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        out = torch.add(bias, y)  # y widened inside the add: one op, the same numbers
        return out if out.dtype == x.dtype else out.to(x.dtype)  # fp16 + bf16 → fp32

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(*args, **kwargs)
        if self.packed:
            self.pack()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        packed = self.packed
        self.packed_weight = None
        out = super()._apply(fn, recurse)
        if packed:
            self.pack()
        return out

    def __getstate__(self) -> dict[str, Any]:
        """For ``copy.deepcopy`` and pickling: without the packed copy (an opaque tensor
        has no storage to copy), which :meth:`__setstate__` packs again."""
        state = dict(super().__getstate__())
        state["packed_weight"] = state["_packed_of"] = None
        state["_repack"] = self.packed
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        repack = state.pop("_repack", False)
        state.setdefault("packed_weight", None)  # pickled before the packed copy existed
        state.setdefault("_packed_of", None)
        super().__setstate__(state)
        if repack:
            self.pack()

    def extra_repr(self) -> str:
        packed = ", packed (oneDNN)" if self.packed else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16{packed}"


def _stamp(weight: Tensor) -> tuple[int, int]:
    """A weight's storage address and write counter; an inference tensor (made under
    ``torch.inference_mode``) counts no writes (−1): only its replacement is seen."""
    return weight.data_ptr(), -1 if weight.is_inference() else weight._version


def one_row_bf16_product(x: Tensor, weight: Tensor) -> Tensor:
    """``F.linear(x, weight)`` of one bf16 row on a CPU through ATen's matrix-vector kernel:
    oneDNN is switched off for the call. The switch is process-wide: these calls take turns
    (so that one thread cannot restore another's "off"), and another thread's product
    during one takes ATen's kernels too: a correct product, perhaps a slower one."""
    mkldnn = torch.backends.mkldnn
    with _MKLDNN_SWITCH:
        enabled = mkldnn.enabled
        try:
            mkldnn.enabled = False
            return F.linear(x, weight)
        finally:
            mkldnn.enabled = enabled


#: Re-entrant: a product that runs another BF16Linear inside (a torch function mode) does
#: not deadlock; the inner call restores the outer one's "off", the outer one the original.
_MKLDNN_SWITCH = threading.RLock()


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


def choose_method(device: torch.device | str = "cpu", backend: str = "auto") -> str:
    """``auto``: on a CPU, int8 where fbgemm's int8 product serves ``backend`` (its dynamic
    linear for ``auto`` and ``dynamic``, :class:`Int8DigitsLinear` for ``weight_only``: the
    fastest decodes measured on every CPU here, AVX512-BF16 ones included), else bf16 where
    the CPU multiplies it natively, else int8; on a CUDA GPU, bf16 where it has it, else
    int8.

    On a 2-core EPYC with AVX512-BF16 (docs/benchmarks.md), GPT-2 small greedy decode against
    transformers fp32: int8 3.81–3.87× at batch 1 and 3.87–4.94× at batch 8, bf16 weights
    2.20–2.41× at batch 1 (ATen's matrix-vector kernel, 17–18 GB/s of weights) and
    2.49–3.28× at batch 8 (oneDNN's packed copy), int8 weight-only 2.80–2.96×."""
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
    """The token embedding of a tied head: its own table (bf16, :class:`Int8Linear`; plain
    next to a packed copy) or an unpacked copy of fbgemm's int8 values (the same numbers)."""
    if isinstance(head, BF16Linear):
        return LowPrecisionEmbedding(head.weight, dtype)
    assert isinstance(head, Int8Linear | DynamicInt8Linear)
    weight, scale = head.int8_weight()
    return Int8Embedding(weight, scale, dtype)


def _weight_tensors(model: nn.Module) -> Iterator[tuple[nn.Module, int, int, bool]]:
    """(module, key, bytes, copy) of every weight a module holds: parameters, the buffers
    of the quantized modules, fbgemm's packed weights (one entry each, keyed by module)
    and oneDNN's packed copy of a :class:`BF16Linear`'s weight (``copy``: a second form of
    a weight counted already, of which a step reads one)."""
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            yield mod, id(p), p.numel() * p.element_size(), False
        if isinstance(mod, Int8Linear | BF16Linear | Int8Embedding | LowPrecisionEmbedding):
            for b in mod.buffers(recurse=False):
                yield mod, id(b), b.numel() * b.element_size(), False
        if isinstance(mod, BF16Linear) and mod.packed:
            yield mod, id(mod), mod.weight.numel() * mod.weight.element_size(), True
        elif isinstance(mod, DynamicInt8Linear):
            yield mod, id(mod), mod.weight_nbytes(), False
        elif _is_legacy_dynamic(mod):
            yield mod, id(mod), _legacy_dynamic_nbytes(mod), False


def _legacy_dynamic_nbytes(mod: nn.Module) -> int:
    with quiet():
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
    weights and per-channel data of converted layers, a packed :class:`BF16Linear`'s
    oneDNN copy included (buffers such as rotary tables, which are recomputed rather than
    loaded, are not counted)."""
    sizes = {key: n for _, key, n, _ in _weight_tensors(model)}
    return sum(sizes.values())


def decode_read_bytes(model: nn.Module) -> int:
    """Weight bytes one decoding step reads: every weight counted by :func:`weight_bytes`
    except tables that are only looked up (token and position embeddings: a step reads a
    few rows of them) and the second form of a packed :class:`BF16Linear`'s weight (a step
    reads one). A tied fp32 head's table counts (the head reads all of it). The KV cache and
    activations are not included."""
    sizes: dict[int, int] = {}
    read: set[int] = set()
    for mod, key, n, copy_ in _weight_tensors(model):
        sizes[key] = n
        if not isinstance(mod, LOOKUPS) and not copy_:
            read.add(key)
    return sum(sizes[k] for k in read)
