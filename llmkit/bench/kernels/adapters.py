"""Per-kind benchmark adapters: what a case of a kind is, how its inputs are made, how its
work is counted, and how its tables look.

A kind names its adapter in its registry record (``bench = "module:attr"``, see
:class:`llmkit.registry.Kind`); :func:`adapter_for` looks it up, so a plugin's kind becomes
benchmarkable by declaring one. An adapter is a :class:`KernelBench`: the built-in
:class:`AttentionBench` times q/k/v kernels, :class:`TokenBench` anything called on
activations of shape (1, tokens, d_model) (feed-forward blocks, norms), with a ``count`` of
FLOPs or bytes.
"""

from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from llmkit.bench.kernels.entries import (
    Entry,
    Prepared,
    build,
    check_capabilities,
    pop_side_outputs,
    trial,
    wrap,
)
from llmkit.bench.kernels.flops import (
    ATTENTION_FLOPS,
    FFN_FLOPS,
    NORM_BYTES,
    attention_flops,
    ffn_work,
    mode_factor,
    norm_work,
)
from llmkit.contracts import BuildContext
from llmkit.errors import RegistryError, first_line

#: Sequence lengths (attention) and token counts (ffn, norm): the default sweeps.
SEQ_LENS = {"cpu": (256, 512, 1024, 2048, 4096), "cuda": (512, 1024, 2048, 4096, 8192)}
TOKENS = {"cpu": (256, 1024, 4096), "cuda": (4096, 16384, 65536)}
HEAD_DIMS = (64, 128)
D_MODEL = {"cpu": 768, "cuda": 4096}
#: ``--quick``: tiny shapes, a couple of seconds in all.
QUICK = {"seq_lens": (64, 128), "tokens": (64, 256), "head_dims": (64,), "d_model": 64}

#: (flops, bytes) of one call of ``module`` on ``x`` in a mode (``fwd`` or ``fwd+bwd``).
WorkCount = Callable[[torch.nn.Module, Tensor, str], tuple[float | None, float | None]]


class NotBenchmarkable(RegistryError, ValueError):
    """A kind ``llmkit bench kernels`` cannot time: unknown, or without a bench adapter."""


class Column(NamedTuple):
    """A case column of the tables: its header, the record field, and a longer label (plot
    axes and panel titles)."""

    header: str
    field: str
    label: str


@dataclass(frozen=True)
class Case:
    """One point of a sweep: a mode, a size on the adapter's x axis, a head dim (for kinds
    that sweep them), and the sweep's settings."""

    mode: str
    size: int
    head_dim: int | None = None
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    causal: bool = True
    batch: int | None = None
    heads: int | None = None
    d_model: int = 768
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class KernelBench(ABC):
    """How ``llmkit bench kernels`` times the components of one kind: its ``bench`` adapter.

    The fields drive the sweep and the reports; a subclass says which record fields describe
    a case (:meth:`fields`) and builds the timed call (:meth:`prepare`).
    """

    #: The component every other one is compared with (None: no ratios by default).
    baseline: str | None
    #: The case columns of the tables, in order; the last one is the x axis of sweeps.
    columns: tuple[Column, ...]
    #: Default x-axis values per device type ("cpu", "cuda").
    sizes: Mapping[str, tuple[int, ...]]
    #: The x-axis values of ``--quick``.
    quick_sizes: tuple[int, ...]
    #: The speed column: "tflops" (FLOP/s of ``Prepared.flops``) or "gbps" (bytes/s).
    rate: str = "tflops"
    #: How the FLOPs (or bytes) are counted, for reports.
    work: str = ""
    #: Sweep head dims too (each case gets one).
    head_dims: bool = False

    def __post_init__(self) -> None:
        if self.rate not in ("tflops", "gbps"):
            raise ValueError(f"rate must be 'tflops' or 'gbps', got {self.rate!r}")
        if not self.columns:
            raise ValueError("an adapter needs at least one column (its x axis)")

    @property
    def axis(self) -> Column:
        """The x axis: the last column."""
        return self.columns[-1]

    @abstractmethod
    def fields(self, case: Case) -> dict[str, Any]:
        """The record fields describing ``case`` (a prepared call may update them)."""

    @abstractmethod
    def prepare(self, entry: Entry, case: Case) -> Prepared:
        """The timed call of ``entry`` on ``case``; raises Unsupported when it cannot run."""

    def shape_note(self, records: list[dict[str, Any]]) -> str:
        """What the title line of ``llmkit bench kernels`` adds about the shapes."""
        return ""


def default_attention_shape(device: str, seq_len: int, head_dim: int) -> tuple[int, int]:
    """(batch, heads): 1×8 on a CPU; on a GPU B = 16384/N and H = 2048/D, so every case
    holds the same tokens × model width (the FlashAttention benchmarks' convention)."""
    if device == "cuda":
        return max(1, 16384 // seq_len), max(1, 2048 // head_dim)
    return 1, 8


def prepare_attention(
    entry: Entry,
    *,
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    mode: str,
    causal: bool = True,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Prepared:
    """The timed call of an attention component on (B, H, N, D) q/k/v; raises Unsupported.

    ``fwd`` runs under ``torch.no_grad`` (inference); ``fwd+bwd`` runs the forward on inputs
    that require grad and ``torch.autograd.grad`` of q, k, v for a fixed random output grad.
    """
    mode_factor(mode, backward=2.5)
    check_capabilities(entry, device, causal)
    ctx = BuildContext(
        d_model=heads * head_dim,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=head_dim,
        max_seq_len=seq_len,
        n_layers=1,
    )
    module = build(entry, ctx, device, dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq_len, head_dim)
    q, k, v = (torch.randn(*shape, generator=gen).to(device=device, dtype=dtype) for _ in "qkv")
    window = getattr(module, "cache_window", None)
    window = int(window) if window else None
    flops = attention_flops(
        batch, heads, seq_len, head_dim, causal=causal, window=window, mode=mode
    )
    if mode == "fwd":

        def fwd() -> Any:
            with torch.no_grad():
                return module(q, k, v, causal=causal)

        step = wrap(entry, fwd)
    else:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        dout = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        def fwd_bwd() -> Any:
            out = module(q, k, v, causal=causal)
            return torch.autograd.grad(out, (q, k, v), dout)

        step = wrap(entry, fwd_bwd)
    trial(step, device)
    info = {"batch": batch, "heads": heads, "seq_len": seq_len, "head_dim": head_dim}
    info.update(causal=causal, window=window)
    return Prepared(step, flops, None, info)


def prepare_tokens(
    entry: Entry,
    *,
    tokens: int,
    d_model: int,
    mode: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    count: WorkCount | None = None,
) -> Prepared:
    """The timed call of a component on x of shape (1, tokens, d_model) (ffn, norm, ...).

    ``fwd+bwd`` takes ``torch.autograd.grad`` of the input and every parameter. ``count``
    gives the work (default: the ``count`` of the component's kind's :class:`TokenBench`).
    """
    if count is None:
        count = _token_count(entry.record.kind)
    mode_factor(mode, backward=2.0)
    check_capabilities(entry, device)
    heads = max(1, d_model // 64)
    ctx = BuildContext(
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=d_model // heads,
        max_seq_len=tokens,
        n_layers=1,
    )
    torch.manual_seed(seed)
    module = build(entry, ctx, device, dtype).train(mode == "fwd+bwd")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, d_model, generator=gen).to(device=device, dtype=dtype)
    if mode == "fwd":

        def fwd() -> Any:
            with torch.no_grad():
                out = module(x)
            pop_side_outputs(module)
            return out

        step = wrap(entry, fwd)
    else:
        x.requires_grad_(True)
        params = [p for p in module.parameters() if p.requires_grad]
        dout = torch.randn(1, tokens, d_model, generator=gen).to(device=device, dtype=dtype)

        def fwd_bwd() -> Any:
            out = module(x)
            pop_side_outputs(module)
            return torch.autograd.grad(out, [x, *params], dout, allow_unused=True)

        step = wrap(entry, fwd_bwd)
    trial(step, device)
    flops, nbytes = count(module, x.detach(), mode)
    return Prepared(step, flops, nbytes, {"tokens": tokens, "d_model": d_model})


def _token_count(kind: str) -> WorkCount:
    adapter = adapter_for(kind)
    if not isinstance(adapter, TokenBench):
        raise ValueError(
            f"{kind} components are not called on tokens (their adapter is a "
            f"{type(adapter).__name__}); pass count="
        )
    return adapter.count


ATTENTION_COLUMNS = (Column("D", "head_dim", "head dim"), Column("N", "seq_len", "sequence length"))
TOKEN_COLUMNS = (Column("tokens", "tokens", "tokens"),)


@dataclass(frozen=True, kw_only=True)
class AttentionBench(KernelBench):
    """Attention kernels on (B, H, N, D) q/k/v, over sequence lengths and head dims; the
    FLOPs count the attended pairs (a window read from the kernel's ``cache_window``)."""

    columns: tuple[Column, ...] = ATTENTION_COLUMNS
    head_dims: bool = True

    def shape(self, case: Case) -> tuple[int, int]:
        """(batch, heads) of a case: the sweep's, else :func:`default_attention_shape`."""
        assert case.head_dim is not None, "attention cases need a head dim"
        b0, h0 = default_attention_shape(case.device, case.size, case.head_dim)
        return case.batch or b0, case.heads or h0

    def fields(self, case: Case) -> dict[str, Any]:
        batch, heads = self.shape(case)
        return {"batch": batch, "heads": heads, "seq_len": case.size,
                "head_dim": case.head_dim, "causal": case.causal, "window": None}  # fmt: skip

    def prepare(self, entry: Entry, case: Case) -> Prepared:
        batch, heads = self.shape(case)
        assert case.head_dim is not None
        return prepare_attention(
            entry, batch=batch, heads=heads, seq_len=case.size, head_dim=case.head_dim,
            mode=case.mode, causal=case.causal, device=case.device, dtype=case.dtype,
            seed=case.seed,
        )  # fmt: skip

    def shape_note(self, records: list[dict[str, Any]]) -> str:
        if not records:
            return ""
        note = ", causal" if records[0]["causal"] else ", non-causal"
        bh = sorted({(r["batch"], r["heads"]) for r in records})
        return note + (f", B={bh[0][0]} H={bh[0][1]}" if len(bh) == 1 else ", B·H by N and D")


@dataclass(frozen=True, kw_only=True)
class TokenBench(KernelBench):
    """Components called on activations x of shape (1, tokens, d_model), over token counts;
    ``count`` gives each call's (flops, bytes)."""

    count: WorkCount
    columns: tuple[Column, ...] = TOKEN_COLUMNS

    def fields(self, case: Case) -> dict[str, Any]:
        return {"tokens": case.size, "d_model": case.d_model}

    def prepare(self, entry: Entry, case: Case) -> Prepared:
        return prepare_tokens(
            entry, tokens=case.size, d_model=case.d_model, mode=case.mode, device=case.device,
            dtype=case.dtype, seed=case.seed, count=self.count,
        )  # fmt: skip

    def shape_note(self, records: list[dict[str, Any]]) -> str:
        return f", width {records[0]['d_model']}" if records else ""


#: The built-in kinds' adapters (named by their registry records' ``bench``).
ATTENTION_ADAPTER = AttentionBench(
    baseline="sdpa",
    sizes=SEQ_LENS,
    quick_sizes=QUICK["seq_lens"],
    rate="tflops",
    work=ATTENTION_FLOPS,
)
FFN_ADAPTER = TokenBench(
    baseline="swiglu",
    sizes=TOKENS,
    quick_sizes=QUICK["tokens"],
    rate="tflops",
    work=FFN_FLOPS,
    count=ffn_work,
)
NORM_ADAPTER = TokenBench(
    baseline="rmsnorm",
    sizes=TOKENS,
    quick_sizes=QUICK["tokens"],
    rate="gbps",
    work=NORM_BYTES,
    count=norm_work,
)


def _registry(registry: Any) -> Any:
    if registry is None:
        from llmkit.registry import get_registry

        registry = get_registry()
    return registry


def benchmarkable_kinds(registry: Any = None) -> list[str]:
    """The kinds whose registry record names a bench adapter, in declaration order."""
    return [k.name for k in _registry(registry).kinds.values() if k.bench]


def adapter_for(kind: str, registry: Any = None) -> KernelBench:
    """The bench adapter of ``kind`` from its registry record; :class:`NotBenchmarkable`
    (one line, listing the benchmarkable kinds) when it has none or it does not load."""
    registry = _registry(registry)
    record = registry.kinds.get(kind)
    known = f"benchmarkable kinds: {', '.join(benchmarkable_kinds(registry)) or 'none'}"
    if record is None:
        close = difflib.get_close_matches(kind, list(registry.kinds), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise NotBenchmarkable(f"unknown kind {kind!r}{hint}; {known}")
    if not record.bench:
        raise NotBenchmarkable(
            f"kind {kind!r} has no kernel benchmark (its record names no bench adapter); {known}"
        )
    try:
        adapter = record.load_bench()
    except Exception as exc:
        why = first_line(exc, typed=True)
        raise NotBenchmarkable(
            f"kind {kind!r}: bench adapter {record.bench!r} failed to load: {why}"
        ) from exc
    if not isinstance(adapter, KernelBench):
        raise NotBenchmarkable(
            f"kind {kind!r}: bench adapter {record.bench!r} is not a "
            f"llmkit.bench.kernels.KernelBench (got {type(adapter).__name__})"
        )
    return adapter
