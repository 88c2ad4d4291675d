"""Parameter-efficient fine-tuning: adapters on a model's linear layers (``model.adapter``).

An adapter component (the ``adapter`` kind; built in: ``lora``, ``dora``) makes one
:class:`~llmkit.contracts.WeightAdapter` per targeted linear layer, registered as a
``torch.nn.utils.parametrize`` parametrization of its weight: every use of ``.weight`` —
``F.linear``, a fused kernel reading the tensor, an export — sees the adapted weight, so
adapters work with any component that owns ``nn.Linear`` layers. Everything else in the
model is frozen except the parameters ``also_train`` names; those and the adapters are the
trainable state, which is all a run with adapters saves (its base weights are the
``train.init_from`` source's). :func:`merge_adapters` folds the adapters into plain weights.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from llmkit.errors import LlmkitError


@dataclass
class AdapterReport:
    """What :func:`attach_adapters` did."""

    name: str
    layers: list[str]
    trainable: int
    total: int

    def line(self) -> str:
        share = 100 * self.trainable / max(self.total, 1)
        return (
            f"adapter: {self.name} on {len(self.layers)} linear layers; {self.trainable:,} of "
            f"{self.total:,} parameters train ({share:.2f}%)"
        )


def _matches(name: str, patterns: list[str]) -> bool:
    return any(
        fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, f"*.{p}") for p in patterns
    )


def _shared_weights(model: nn.Module) -> set[int]:
    """Ids of parameters that more than one module holds (tied embeddings)."""
    seen: dict[int, int] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def attach_adapters(model: nn.Module, resolved: object, also: Sequence[str] = ()) -> AdapterReport:
    """Give every linear layer the resolved adapter component's ``targets`` match an adapter,
    and freeze all but the adapters, ``also_train`` and the parameters named in ``also``
    (those a vocabulary resize gave new rows: they must train, and be saved with the
    adapters, or the run could not be loaded as it was trained). A pattern that matches no
    linear layer (or only tied ones) is a one-line error listing the model's linear
    layers."""
    options = resolved.options  # type: ignore[attr-defined]
    build = resolved.build  # type: ignore[attr-defined]
    shared = _shared_weights(model)
    linears = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and not parametrize.is_parametrized(m, "weight")
    ]
    chosen = [(n, m) for n, m in linears if _matches(n, options.targets)]
    tied = [n for n, m in chosen if id(m.weight) in shared]
    chosen = [(n, m) for n, m in chosen if id(m.weight) not in shared]
    for pattern in options.targets:
        if not any(_matches(n, [pattern]) for n, _ in chosen):
            names = sorted({_generic(n) for n, _ in linears})
            why = f" (only tied weights: {', '.join(tied)})" if tied else ""
            raise LlmkitError(
                f"model.adapter.targets: {pattern!r} matches no linear layer{why}; the "
                f"model's are {', '.join(names)}"
            )
    for p in model.parameters():
        p.requires_grad_(False)
    for _, mod in chosen:
        adapter = build(options, mod.weight.detach())
        adapter.to(device=mod.weight.device)
        parametrize.register_parametrization(mod, "weight", adapter)
        mod.parametrizations.weight.original.requires_grad_(False)
        for p in adapter.parameters():
            p.requires_grad_(True)
    extra = [n for n, p in model.named_parameters() if _matches(n, options.also_train)]
    for pattern in options.also_train:
        if not any(_matches(n, [pattern]) for n in extra):
            raise LlmkitError(f"model.adapter.also_train: {pattern!r} matches no parameter")
    params = dict(model.named_parameters())
    for n in [*extra, *(_after_parametrization(n, params) for n in also)]:
        params[n].requires_grad_(True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return AdapterReport(resolved.name, [n for n, _ in chosen], trainable, total)  # type: ignore[attr-defined]


def _after_parametrization(name: str, params: dict[str, nn.Parameter]) -> str:
    """``name`` of a weight, or of its original once an adapter parametrizes it."""
    if name in params:
        return name
    module, _, attr = name.rpartition(".")
    original = f"{module}.parametrizations.{attr}.original"
    if original not in params:
        raise LlmkitError(f"model.adapter: no parameter {name} to train")
    return original


def _generic(name: str) -> str:
    """``layers.3.attn.qkv`` → ``layers.*.attn.qkv`` (for listing a model's layers)."""
    parts = name.split(".")
    return ".".join("*" if p.isdigit() else p for p in parts)


def has_adapters(model: nn.Module) -> bool:
    """Whether any module of ``model`` carries an adapter."""
    return any(parametrize.is_parametrized(m) for m in model.modules())


def trainable_state(model: nn.Module) -> dict[str, Tensor]:
    """The parameters that train (adapters and ``also_train``), by name, detached,
    contiguous and on the CPU: what a run with adapters saves."""
    return {
        n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters() if p.requires_grad
    }


@torch.no_grad()
def load_trainable_state(model: nn.Module, tensors: dict[str, Tensor], where: str) -> None:
    """Load :func:`trainable_state` tensors back; every trainable parameter must be there
    with its shape, and nothing else."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        what = f"missing {missing[:2]}" if missing else f"unexpected {unexpected[:2]}"
        raise LlmkitError(f"{where}: adapter weights do not fit the model's adapters ({what})")
    for n, t in tensors.items():
        if tuple(t.shape) != tuple(params[n].shape):
            raise LlmkitError(
                f"{where}: {n} is {tuple(t.shape)} in the file and {tuple(params[n].shape)} "
                "in the model"
            )
        params[n].copy_(t)


@torch.no_grad()
def merge_adapters(model: nn.Module) -> int:
    """Replace every adapted weight by its adapted value and drop the adapters (the model is
    then a plain model with the same outputs); every parameter trains again. Returns the
    number of layers merged."""
    merged = 0
    for mod in model.modules():
        if parametrize.is_parametrized(mod, "weight"):
            parametrize.remove_parametrizations(mod, "weight", leave_parametrized=True)
            merged += 1
    for p in model.parameters():
        p.requires_grad_(True)
    return merged
