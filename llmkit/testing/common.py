"""Helpers every check shares: failure messages naming the component, tolerances, seeded
RNG, building a component the way the model does (:func:`small_context`,
:func:`init_like_model`), options (:func:`build_options`) and gradient checks."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
from torch import Tensor, nn

from llmkit.contracts import BuildContext, SideOutputs

Record = Any  # llmkit.registry.Component (duck-typed: kind, name, provider, capabilities, ...)
Options = Mapping[str, Any] | None


def _label(record: Record) -> str:
    return f"{record.kind} {record.name!r} (from {getattr(record, 'provider', '?')})"


def _fail(record: Record, message: str) -> NoReturn:
    raise AssertionError(f"{_label(record)}: {message}")


def _expect(condition: bool, record: Record, message: str) -> None:
    if not condition:
        _fail(record, message)


def _maxdiff(a: Tensor, b: Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.detach().float() - b.detach().float()).abs().max().item()


def _close(a: Tensor, b: Tensor, atol: float, rtol: float = 0.0) -> bool:
    return a.shape == b.shape and torch.allclose(
        a.detach().float(), b.detach().float(), atol=atol, rtol=rtol
    )


def _capabilities(record: Record) -> dict[str, Any]:
    return dict(getattr(record, "capabilities", None) or {})


def _device(record: Record, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if "cuda" in _capabilities(record).get("requires", []):
        return torch.device("cuda")
    return torch.device("cpu")


def _dtypes(record: Record) -> list[torch.dtype]:
    names = _capabilities(record).get("dtypes", ["float32", "bfloat16"])
    return [getattr(torch, n) for n in names]


def _tolerance(device: torch.device) -> float:
    """fp32 tolerance against a reference: GPUs may run matmuls in TF32."""
    return 1e-4 if device.type == "cpu" else 3e-3


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch inside, restoring the global RNG state afterwards."""
    devices = [] if device.type != "cuda" else [device.index or torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _randn(gen: torch.Generator, *shape: int, device: torch.device, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device)


def _run(record: Record, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``, turning an exception into an AssertionError that says what was tried."""
    try:
        return fn(*args, **kwargs)
    except AssertionError:
        raise
    except Exception as exc:
        _fail(record, f"{what} raised {type(exc).__name__}: {exc}")


def _load(record: Record) -> Any:
    try:
        target = record.load()
    except Exception as exc:
        _fail(record, f"its target failed to import: {type(exc).__name__}: {exc}")
    _expect(callable(target), record, f"its target {target!r} is not callable")
    return target


def _options_model(record: Record) -> Any:
    try:
        return record.options_model()
    except Exception as exc:
        _fail(record, f"its options model failed to load: {type(exc).__name__}: {exc}")


def build_options(record: Record, options: Options = None) -> Any:
    """The component's options instance, validated from ``options`` (default: all defaults)."""
    model = _options_model(record)
    try:
        return model.model_validate(dict(options or {}))
    except Exception as exc:
        what = "its default options" if not options else f"options {dict(options)!r}"
        _fail(record, f"{what} do not validate: {exc}")


def _option_fields(record: Record) -> set[str]:
    try:
        return set(getattr(record.options_model(), "model_fields", {}))
    except Exception:
        return set()


def small_context(**overrides: Any) -> BuildContext:
    """The BuildContext the checks use: d_model 32, 4 heads of 8, 2 kv heads, 64 positions."""
    values: dict[str, Any] = {
        "d_model": 32,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 8,
        "max_seq_len": 64,
        "n_layers": 2,
        "layer": 0,
        "dropout": 0.0,
        "bias": True,
    }
    values.update(overrides)
    return BuildContext(**values)


def init_like_model(module: nn.Module, std: float = 0.02) -> nn.Module:
    """Initialize a component the way :class:`llmkit.model.Transformer` does: a module with an
    ``init_weights(std)`` method initializes itself (and its children); otherwise ``nn.Linear``
    and ``nn.Embedding`` weights get Normal(0, std) and linear biases zeros."""
    owned: list[str] = []  # modules that initialized themselves, with their subtrees
    for name, mod in module.named_modules():
        if any(o == "" or name == o or name.startswith(o + ".") for o in owned):
            continue
        if callable(getattr(mod, "init_weights", None)):
            mod.init_weights(std)
            owned.append(name)
        elif isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, 0.0, std)
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.Embedding):
            nn.init.normal_(mod.weight, 0.0, std)
    return module


def _build_module(record: Record, options: Options, ctx: BuildContext, device: torch.device):
    factory = _load(record)
    opts = build_options(record, options)
    with _seeded(0, device):
        module = _run(record, f"building it with {ctx}", factory, opts, ctx)
        _expect(
            isinstance(module, nn.Module),
            record,
            f"building it returned {type(module).__name__}, not an nn.Module",
        )
        init_like_model(module)
    return _run(record, f"moving it with .to({str(device)!r})", module.to, device)


def _check_grads(record: Record, module: nn.Module, what: str) -> None:
    """Every trainable parameter of ``module`` got a finite, non-zero gradient."""
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        _expect(p.grad is not None, record, f"{what}: no gradient reaches parameter {name!r}")
        _expect(
            bool(torch.isfinite(p.grad).all()),
            record,
            f"{what}: the gradient of parameter {name!r} is not finite",
        )
        _expect(
            bool(p.grad.abs().sum() > 0),
            record,
            f"{what}: the gradient of parameter {name!r} is exactly zero",
        )


def _check_input_grad(record: Record, t: Tensor, name: str, what: str) -> None:
    _expect(t.grad is not None, record, f"{what}: no gradient reaches {name}")
    _expect(
        bool(torch.isfinite(t.grad).all()), record, f"{what}: the gradient of {name} is not finite"
    )
    _expect(bool(t.grad.abs().sum() > 0), record, f"{what}: the gradient of {name} is exactly zero")


def _check_side_outputs(record: Record, module: nn.Module) -> None:
    for name, mod in module.named_modules():
        if not isinstance(mod, SideOutputs):
            continue
        losses, _ = mod.pop_side_outputs()
        for key, value in losses.items():
            _expect(
                isinstance(value, Tensor) and value.numel() == 1,
                record,
                f"auxiliary loss {name or '.'}:{key} must be a scalar tensor, got {value!r}",
            )
            _expect(
                bool(torch.isfinite(value).all()),
                record,
                f"auxiliary loss {name or '.'}:{key} is not finite",
            )
