"""The ``block`` kind: residual blocks ``Block(options, ctx, parts)``; ``forward(x, inputs)``
(see :mod:`llmkit.contracts`).

The block is checked alone, on simple stand-in parts (an attention module around
:func:`llmkit.ops.reference_attention`, a two-layer MLP, ``nn.LayerNorm``), then inside a tiny
model built through the spec loader (:func:`~llmkit.testing.check_model_combination`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from llmkit.contracts import (
    AttentionInputs,
    BlockParts,
    BuildContext,
    NoOptions,
    PositionalScheme,
)
from llmkit.testing.combinations import check_model_combination
from llmkit.testing.common import (
    Options,
    Record,
    _check_grads,
    _check_input_grad,
    _close,
    _device,
    _dtypes,
    _expect,
    _load,
    _maxdiff,
    _randn,
    _run,
    _seeded,
    build_options,
    init_like_model,
    small_context,
)


class _MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def block_parts(ctx: BuildContext) -> BlockParts:
    """Stand-in parts for checking a block alone: an attention module around the reference
    kernel (the built-in ``dense``, :func:`llmkit.ops.reference_attention`), a two-layer GELU
    MLP and ``nn.LayerNorm`` norms."""
    from llmkit.model.attention import Attention
    from llmkit.registry import get_registry

    dense = get_registry().get("attention", "dense")
    return BlockParts(
        attention=Attention(ctx, dense.load()(dense.parse_options({}), ctx)),
        ffn=_MLP(ctx.d_model),
        norm=lambda: nn.LayerNorm(ctx.d_model),
    )


def _build_block(
    record: Record, options: Options, ctx: BuildContext, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, BlockParts]:
    factory = _load(record)
    opts = build_options(record, options)
    with _seeded(0, device):
        parts = block_parts(ctx)
        block = _run(record, "building it with (options, ctx, parts)", factory, opts, ctx, parts)
        _expect(
            isinstance(block, nn.Module),
            record,
            f"building it returned {type(block).__name__}, not an nn.Module",
        )
        init_like_model(block)
    kept = {id(m) for m in block.modules()}
    for part, what in ((parts.attention, "parts.attention"), (parts.ffn, "parts.ffn")):
        _expect(id(part) in kept, record, f"it does not keep {what} as a submodule")
    return block.to(device=device, dtype=dtype), parts


def _inputs(t: int, device: torch.device) -> AttentionInputs:
    """No positional information (the base scheme acts nowhere), positions 0..t-1."""
    none = PositionalScheme(NoOptions(), small_context())
    return AttentionInputs(none, torch.arange(t, device=device))


def check_block(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """Check a block: it keeps the attention module and ffn it is given; output shape and
    dtype; gradients to the input and every parameter; causality; rows of a batch are
    independent; deterministic; the residual path survives when both sublayers output zero
    (a block that drops a residual collapses then); bfloat16; then, in a tiny model (sdpa,
    rope, mlp, layernorm) using it on every layer: training, causality and KV-cache decoding
    equal to the full forward, and activation checkpointing giving the same gradients."""
    dev = _device(record, device)
    ctx = small_context()
    B, T, C = 2, 12, ctx.d_model
    gen = torch.Generator().manual_seed(0)
    block, parts = _build_block(record, options, ctx, dev, torch.float32)
    x = _randn(gen, B, T, C, device=dev).requires_grad_(True)
    out = _run(record, "forward", block, x, _inputs(T, dev))
    _expect(isinstance(out, Tensor), record, f"forward returned {type(out).__name__}")
    _expect(out.shape == x.shape, record, f"output shape {tuple(out.shape)} != input {x.shape}")
    _expect(out.dtype == x.dtype, record, f"output dtype {out.dtype} != input {x.dtype}")
    _expect(bool(torch.isfinite(out).all()), record, "output is not finite")
    (out * _randn(gen, *out.shape, device=dev)).sum().backward()
    _check_grads(record, block, "backward")
    _check_input_grad(record, x, "the block input", "backward")

    block.eval()
    with torch.no_grad():
        x = x.detach()
        full = block(x, _inputs(T, dev))
        _expect(torch.equal(full, block(x, _inputs(T, dev))), record, "not deterministic")
        cut = T // 2
        changed = x.clone()
        changed[:, cut:] += _randn(gen, B, T - cut, C, device=dev)
        other = block(changed, _inputs(T, dev))
        _expect(
            _close(other[:, :cut], full[:, :cut], 1e-5, 1e-5),
            record,
            f"not causal: changing positions {cut}.. changed earlier outputs by "
            f"{_maxdiff(other[:, :cut], full[:, :cut]):.2e}",
        )
        rows = x.clone()
        rows[1] += 1.0
        _expect(
            _close(block(rows, _inputs(T, dev))[0], full[0], 1e-5, 1e-5),
            record,
            "changing one batch row changed another row's output",
        )
        _check_residual(record, block, parts, x, dev)
    for dtype in _dtypes(record):
        if dtype != torch.float32:
            _check_dtype(record, options, ctx, dev, dtype, x)
    _check_in_model(record, options, dev)


def _check_residual(
    record: Record, block: nn.Module, parts: BlockParts, x: Tensor, dev: torch.device
) -> None:
    """With every parameter of attention and ffn zeroed both sublayers output zero; the input
    must still reach the output (exactly, for blocks whose norms sit inside the residual)."""
    for p in [*parts.attention.parameters(), *parts.ffn.parameters()]:
        p.zero_()
    a = block(x, _inputs(x.shape[1], dev))
    b = block(x + torch.randn_like(x), _inputs(x.shape[1], dev))
    _expect(
        _maxdiff(a, b) > 1e-4,
        record,
        "with attention and ffn outputting zero, the output no longer depends on the input: "
        "the residual path is missing",
    )


def _check_dtype(
    record: Record,
    options: Options,
    ctx: BuildContext,
    dev: torch.device,
    dtype: torch.dtype,
    x: Tensor,
) -> None:
    block, _ = _build_block(record, options, ctx, dev, dtype)
    out = _run(record, f"forward in {dtype}", block, x.to(dtype), _inputs(x.shape[1], dev))
    _expect(out.dtype == dtype, record, f"a {dtype} input gave a {out.dtype} output")
    _expect(bool(torch.isfinite(out).all()), record, f"{dtype} output is not finite")


class _WithRecord:
    """A registry that answers with ``record`` for its kind and name, and otherwise asks
    ``base`` (so a record from any registry can be checked inside a model)."""

    def __init__(self, base: Any, record: Record) -> None:
        self.base, self.record = base, record

    def get(self, kind: str, name: str) -> Any:
        if (kind, name) == (self.record.kind, self.record.name):
            return self.record
        return self.base.get(kind, name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.base, attr)


def model_registry(record: Record) -> Any:
    """The process registry with ``record`` in it (see :class:`_WithRecord`)."""
    from llmkit.registry import get_registry

    return _WithRecord(get_registry(), record)


def _check_in_model(record: Record, options: Options, dev: torch.device) -> None:
    ref = {"name": record.name, **dict(options or {})}
    registry = model_registry(record)
    model = _run(
        record,
        "a tiny model using it",
        check_model_combination,
        "sdpa",
        "rope",
        "mlp",
        "layernorm",
        model={"block": ref},
        registry=registry,
        device=dev,
    )
    _check_recompute(record, model, dev)


def _check_recompute(record: Record, model: Any, dev: torch.device) -> None:
    """Activation checkpointing (the block re-run in backward) gives the same gradients."""
    idx = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator())
    idx = idx.to(dev)
    model.train()
    grads = []
    for recompute in (False, True):
        model.zero_grad()
        model.activation_checkpointing = recompute
        model(idx, idx).total_loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    model.activation_checkpointing = False
    same = len(grads[0]) == len(grads[1]) and all(
        _close(a, b, 1e-5, 1e-4) for a, b in zip(*grads, strict=True)
    )
    _expect(same, record, "activation checkpointing changes the gradients")
