"""The ``adapter`` kind: ``Adapter(options: AdapterOptions, weight)`` for one linear layer's
weight (out, in), registered as a ``torch.nn.utils.parametrize`` parametrization of it;
``forward(weight)`` returns the adapted weight (see :class:`llmkit.contracts.WeightAdapter`
and :mod:`llmkit.model.adapters`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from llmkit.contracts import AdapterOptions, WeightAdapter
from llmkit.testing.common import (
    Options,
    Record,
    _check_grads,
    _close,
    _device,
    _dtypes,
    _expect,
    _load,
    _maxdiff,
    _options_model,
    _randn,
    _run,
    _seeded,
    _tolerance,
    build_options,
)

#: The (out_features, in_features) of the weights the checks adapt: not square, so a
#: transposed update shows.
OUT, IN = 24, 16


def _build(record: Record, options: Options, weight: Tensor, seed: int = 0) -> WeightAdapter:
    factory = _load(record)
    opts = build_options(record, options)
    shape = tuple(weight.shape)
    before = weight.detach().clone()
    with _seeded(seed, weight.device):
        adapter = _run(
            record, f"building it for a {weight.dtype} weight {shape}", factory, opts, weight
        )
    _expect(
        isinstance(adapter, WeightAdapter),
        record,
        f"building it returned {type(adapter).__name__}, not a WeightAdapter (an nn.Module "
        "subclassing llmkit.WeightAdapter)",
    )
    _expect(
        torch.equal(weight, before),
        record,
        "building it modified the base weight (the base weight is frozen and not the "
        "adapter's: the adapter must only read it)",
    )
    return _run(record, f"moving it with .to({str(weight.device)!r})", adapter.to, weight.device)


def _call(record: Record, adapter: nn.Module, weight: Tensor, what: str) -> Tensor:
    out = _run(record, what, adapter, weight)
    _expect(
        isinstance(out, Tensor), record, f"{what} must return a tensor, got {type(out).__name__}"
    )
    _expect(
        out.shape == weight.shape,
        record,
        f"{what}: wrong shape: the adapted weight is {tuple(out.shape)}, the weight "
        f"{tuple(weight.shape)}",
    )
    _expect(
        out.dtype == weight.dtype,
        record,
        f"{what}: wrong dtype: the adapted weight is {out.dtype}, the weight {weight.dtype}",
    )
    _expect(bool(torch.isfinite(out).all()), record, f"{what}: the adapted weight is not finite")
    return out


def _trainable(record: Record, adapter: nn.Module) -> None:
    _expect(
        any(p.requires_grad for p in adapter.parameters()),
        record,
        "no trainable parameters: an adapter's own parameters are what fine-tuning trains",
    )


@torch.no_grad()
def _perturb(adapter: nn.Module, seed: int) -> None:
    """Move every trainable parameter off its initialization (a zero-initialized update, as
    LoRA's B, would otherwise leave the other factor without a gradient)."""
    gen = torch.Generator().manual_seed(seed)
    for p in adapter.parameters():
        if p.requires_grad:
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.add_(noise.to(device=p.device, dtype=p.dtype))


def _state(adapter: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in adapter.state_dict().items()}


def check_adapter(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """Check a weight adapter: its options subclass AdapterOptions (``targets``,
    ``also_train``); built for a (24, 16) weight it is a WeightAdapter that leaves the weight
    alone; ``forward(weight)`` keeps the shape and dtype; at initialization the adapted
    weight equals the weight (a fine-tuned model starts as its base); it has trainable
    parameters, changing them changes the adapted weight, and gradients reach every one of
    them; it is a function of the weight alone (two calls equal in train mode, train and
    eval mode equal, no state changes); its state_dict restores it; registered as a
    parametrization of an ``nn.Linear`` the layer computes with the adapted weight, gradients
    reach the adapter and not the frozen weight, and merging (weight := forward(weight))
    keeps the outputs; bfloat16."""
    dev = _device(record, device)
    model = _options_model(record)
    _expect(
        isinstance(model, type) and issubclass(model, AdapterOptions),
        record,
        f"its options model {getattr(model, '__name__', model)!r} does not subclass "
        "llmkit.AdapterOptions (which gives every adapter its targets and also_train)",
    )
    opts = build_options(record, options)
    for name in ("targets", "also_train"):
        _expect(
            isinstance(getattr(opts, name, None), list),
            record,
            f"its options lack {name!r} (a list of glob patterns, from AdapterOptions)",
        )
    gen = torch.Generator().manual_seed(0)
    tol = _tolerance(dev)
    weight = _randn(gen, OUT, IN, device=dev, scale=0.5)

    # initialization: the identity on the weight it was built for
    adapter = _build(record, options, weight)
    adapter.train()
    out = _call(record, adapter, weight, "forward(weight)")
    _expect(
        _close(out, weight, tol, tol),
        record,
        "at initialization the adapted weight differs from the base weight by "
        f"{_maxdiff(out, weight):.2e} (an adapter must start as the identity, e.g. with a "
        "zero-initialized update, so fine-tuning starts from the base model)",
    )
    _trainable(record, adapter)

    # training: its parameters matter and get gradients
    _perturb(adapter, 1)
    moved = _call(record, adapter, weight, "forward(weight) after a training step")
    _expect(
        not _close(moved, out, 1e-6),
        record,
        "changing its trainable parameters does not change the adapted weight",
    )
    w = _randn(gen, OUT, IN, device=dev)
    (moved * w).sum().backward()
    _check_grads(record, adapter, "backward through forward(weight)")

    # a function of the weight alone
    with torch.no_grad():
        state = _state(adapter)
        first = _call(record, adapter, weight, "forward(weight) in train mode")
        again = _call(record, adapter, weight, "a second forward(weight) in train mode")
        _expect(
            torch.equal(first, again),
            record,
            f"not deterministic: two calls in train mode differ by {_maxdiff(first, again):.2e} "
            "(no dropout or noise: merging applies forward(weight) once)",
        )
        adapter.eval()
        held = _call(record, adapter, weight, "forward(weight) in eval mode")
        _expect(
            torch.equal(first, held),
            record,
            f"not deterministic: train and eval mode differ by {_maxdiff(first, held):.2e} "
            "(no dropout: merging must give the model that trained)",
        )
        after = _state(adapter)
        changed = [k for k in state if not torch.equal(state[k], after[k])]
        _expect(
            not changed and set(state) == set(after),
            record,
            f"forward changes its state ({', '.join(changed) or 'state_dict keys'}): an "
            "adapter must be a function of the weight alone",
        )

        # what a run saves restores it
        fresh = _build(record, options, weight, seed=1)
        _run(record, "loading its state_dict into a fresh adapter", fresh.load_state_dict, state)
        restored = _call(record, fresh, weight, "forward(weight) after load_state_dict")
        _expect(
            _close(restored, held, tol, tol),
            record,
            "a fresh adapter given its state_dict computes a different adapted weight (by "
            f"{_maxdiff(restored, held):.2e}): keep all its state in parameters or buffers",
        )

    _check_linear(record, options, dev, gen, tol)
    for dtype in _dtypes(record):
        if dtype != torch.float32:
            _check_dtype(record, options, weight.to(dtype), gen)


def _check_linear(
    record: Record, options: Options, dev: torch.device, gen: torch.Generator, tol: float
) -> None:
    """As llmkit applies it: a parametrization of an nn.Linear's weight, then merged."""
    linear = nn.Linear(IN, OUT).to(dev)
    with torch.no_grad():
        linear.weight.copy_(_randn(gen, OUT, IN, device=dev, scale=0.5))
        linear.bias.copy_(_randn(gen, OUT, device=dev))
    base = linear.weight.detach().clone()
    adapter = _build(record, options, base)
    _perturb(adapter, 2)
    with torch.no_grad():
        expected_weight = _call(record, adapter, base, "forward(weight)")
    _run(
        record,
        "registering it as a parametrization of an nn.Linear's weight",
        parametrize.register_parametrization,
        linear,
        "weight",
        adapter,
    )
    linear.parametrizations.weight.original.requires_grad_(False)
    x = _randn(gen, 3, 5, IN, device=dev)
    y = _run(record, "an nn.Linear it parametrizes", linear, x)
    expected = F.linear(x, expected_weight, linear.bias)
    _expect(
        _close(y, expected, tol, tol),
        record,
        "as a parametrization of an nn.Linear the layer's output differs from "
        f"F.linear(x, forward(weight)) by {_maxdiff(y, expected):.2e}",
    )
    (y * _randn(gen, *y.shape, device=dev)).sum().backward()
    _check_grads(record, adapter, "backward through an nn.Linear it parametrizes")
    _expect(
        linear.parametrizations.weight.original.grad is None,
        record,
        "a gradient reached the frozen base weight",
    )
    with torch.no_grad():
        _run(
            record,
            "merging it (remove_parametrizations(..., leave_parametrized=True))",
            parametrize.remove_parametrizations,
            linear,
            "weight",
            leave_parametrized=True,
        )
        merged = linear(x)
    _expect(
        _close(merged, y, tol, tol),
        record,
        f"merging it changes the layer's outputs by {_maxdiff(merged, y):.2e}",
    )


def _check_dtype(record: Record, options: Options, weight: Tensor, gen: torch.Generator) -> None:
    adapter = _build(record, options, weight)
    out = _call(record, adapter, weight, f"forward(weight) in {weight.dtype}")
    tol = 2e-2
    _expect(
        _close(out, weight, tol, tol),
        record,
        f"in {weight.dtype} at initialization the adapted weight differs from the base weight "
        f"by {_maxdiff(out, weight):.2e}",
    )
    _perturb(adapter, 3)
    moved = _call(record, adapter, weight, f"forward(weight) in {weight.dtype} after a step")
    (moved.float() * _randn(gen, *moved.shape, device=weight.device)).sum().backward()
    _check_grads(record, adapter, f"backward in {weight.dtype}")
