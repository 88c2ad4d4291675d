"""``llmkit plugin new``: generate a plugin package that installs and passes its own tests.

The package holds a pyproject.toml declaring the ``llmkit`` entry point, a module with the
hook implementation, one component of the chosen kind with its options model, a test module
running llmkit's conformance suite over it, and a README. Templates are plain strings
(``string.Template``, ``$name`` placeholders); nothing here imports torch.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

from llmkit.errors import LlmkitError

KINDS = ("attention", "ffn", "norm", "position", "optimizer", "schedule")
MODEL_KINDS = ("attention", "ffn", "norm", "position")

_DIST_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
_COMPONENT_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_RESERVED = {"llmkit", "builtin"}


@dataclass(frozen=True)
class PluginNames:
    """Every name a generated plugin uses, derived from the distribution name."""

    distribution: str  # llmkit-foo            (pip install, requires = [...])
    package: str  # llmkit_foo                  (the import name)
    entry_point: str  # foo                     (LLMKIT_PLUGINS, llmkit plugins)
    kind: str  # ffn
    component: str  # foo                       (what specs name: { name = "foo" })
    module: str  # foo                          (llmkit_foo/foo.py)
    cls: str  # FooFFN                           (the component's class, or the optimizer's)

    @property
    def target(self) -> str:
        attr = "build" if self.kind in ("optimizer", "schedule") else self.cls
        return f"{self.package}.{self.module}:{attr}"


_SUFFIX = {
    "attention": "Attention",
    "ffn": "FFN",
    "norm": "Norm",
    "position": "Position",
    "optimizer": "Optimizer",
    "schedule": "Schedule",
}


def plugin_names(name: str, kind: str = "ffn", component: str | None = None) -> PluginNames:
    """Derive and validate the names of a plugin called ``name`` (its distribution name, e.g.
    ``llmkit-foo``). Raises :class:`LlmkitError` for a name that cannot work."""
    if kind not in KINDS:
        raise LlmkitError(f"unknown kind {kind!r}; choose one of: {', '.join(KINDS)}")
    if not _DIST_RE.match(name):
        raise LlmkitError(
            f"{name!r} is not a valid distribution name: use letters, digits, '-', '_' and "
            "'.', starting and ending with a letter or digit (e.g. llmkit-my-ffn)"
        )
    package = re.sub(r"[-_.]+", "_", name).lower()
    entry_point = package.removeprefix("llmkit_") or package
    if package in _RESERVED or entry_point in _RESERVED:
        raise LlmkitError(f"{name!r} is reserved by llmkit; choose another name")
    if not package.isidentifier() or keyword.iskeyword(package) or package[0].isdigit():
        raise LlmkitError(
            f"{name!r} gives the Python package name {package!r}, which is not an identifier; "
            "start the name with a letter"
        )
    comp = component if component is not None else entry_point
    if not _COMPONENT_RE.match(comp) or keyword.iskeyword(comp):
        raise LlmkitError(
            f"component name {comp!r}: use lowercase letters, digits and '_', starting with a "
            "letter (set it with --component)"
        )
    cls = "".join(part.capitalize() for part in comp.split("_") if part) + _SUFFIX[kind]
    return PluginNames(name, package, entry_point, kind, comp, comp, cls)


def render(names: PluginNames) -> dict[str, str]:
    """The generated files: relative path → text."""
    n = names
    values = {
        "dist": n.distribution,
        "pkg": n.package,
        "ep": n.entry_point,
        "kind": n.kind,
        "component": n.component,
        "module": n.module,
        "cls": n.cls,
        "target": n.target,
        "summary": _SUMMARY[n.kind],
        "capabilities": _CAPABILITIES[n.kind],
        "in_a_model": _IN_A_MODEL[n.kind],
        "spec_ref": _SPEC_REF[n.kind],
        "spec_toml": _SPEC_TOML[n.kind],
        "testing_imports": "check_component, check_model_combination, conformance_params"
        if n.kind in MODEL_KINDS
        else "check_component, conformance_params",
    }

    def fill(template: str) -> str:
        return Template(template).substitute(values)

    values["in_a_model"] = fill(values["in_a_model"])
    values["spec_ref"] = fill(values["spec_ref"])
    values["spec_toml"] = fill(values["spec_toml"])
    return {
        "pyproject.toml": fill(_PYPROJECT),
        "README.md": fill(_README),
        f"{n.package}/__init__.py": fill(_INIT),
        f"{n.package}/{n.module}.py": fill(_COMPONENT[n.kind]),
        f"tests/test_{n.package}.py": fill(_TEST),
    }


def new_plugin(
    name: str,
    kind: str = "ffn",
    directory: str | Path = ".",
    component: str | None = None,
) -> tuple[Path, PluginNames, list[Path]]:
    """Write the plugin ``name`` into ``directory/name``; return its root, names and files.

    Refuses to write into an existing, non-empty directory.
    """
    names = plugin_names(name, kind, component)
    root = Path(directory) / names.distribution
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise LlmkitError(f"{root} already exists and is not empty; choose another --dir or name")
    files = []
    for rel, text in render(names).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        files.append(path)
    return root, names, files


# -- templates --------------------------------------------------------------------------------

_SUMMARY = {
    "attention": "Softmax attention in plain PyTorch (a starting point)",
    "ffn": "Two-layer GELU MLP (a starting point)",
    "norm": "RMS normalization with a learned gain (a starting point)",
    "position": "Sinusoidal encodings added to the embeddings (a starting point)",
    "optimizer": "SGD with heavy-ball momentum and decoupled weight decay (a starting point)",
    "schedule": "Linear warmup, then linear decay to a floor (a starting point)",
}

# Capabilities: what the spec resolver, the model and the conformance suite read
# (see docs/plugins/contracts.md).
_CAPABILITIES = {
    "attention": """
        capabilities={
            "positions": ["embedding", "qk", "score_bias"],
            "kv_cache": True,
            "gqa": True,
            "materializes_scores": True,
        },""",
    "ffn": "",
    "norm": "",
    "position": """
        capabilities={"acts_on": ["embedding"]},""",
    "optimizer": "",
    "schedule": "",
}

_IN_A_MODEL = {
    "attention": """

def test_in_a_model_that_trains_and_decodes_with_a_kv_cache():
    check_model_combination(COMPONENT, "rope", "mlp", "layernorm", registry=REGISTRY)
""",
    "ffn": """

def test_in_a_model_that_trains_and_decodes_with_a_kv_cache():
    check_model_combination("sdpa", "rope", COMPONENT, "layernorm", registry=REGISTRY)
""",
    "norm": """

def test_in_a_model_that_trains_and_decodes_with_a_kv_cache():
    check_model_combination("sdpa", "rope", "mlp", COMPONENT, registry=REGISTRY)
""",
    "position": """

def test_in_a_model_that_trains_and_decodes_with_a_kv_cache():
    check_model_combination("sdpa", COMPONENT, "mlp", "layernorm", registry=REGISTRY)
""",
    "optimizer": "",
    "schedule": "",
}

_SPEC_REF = {
    **{kind: '{"model": {**MODEL, "$kind": {"name": COMPONENT}}}' for kind in MODEL_KINDS},
    "optimizer": '{"model": MODEL, "optimizer": {"name": COMPONENT}}',
    "schedule": '{"model": MODEL, "schedule": {"name": COMPONENT}}',
}

_SPEC_TOML = {
    "attention": '[model]\nattention = { name = "$component" }',
    "ffn": '[model]\nffn = { name = "$component", multiplier = 4.0 }',
    "norm": '[model]\nnorm = { name = "$component", eps = 1e-6 }',
    "position": '[model]\nposition = { name = "$component" }',
    "optimizer": '[optimizer]\nname = "$component"\nlr = 1e-2\nmomentum = 0.9',
    "schedule": '[schedule]\nname = "$component"\nwarmup_steps = 100',
}

_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "An llmkit plugin: the $kind component '$component'."
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["llmkit>=0.1"]

[project.optional-dependencies]
test = ["pytest>=8"]

# What makes this package a plugin: llmkit imports the module named here and calls its hooks.
# The name on the left is the plugin's name in `llmkit plugins` and $$LLMKIT_PLUGINS.
[project.entry-points.llmkit]
$ep = "$pkg"

[tool.setuptools.packages.find]
include = ["$pkg*"]

[tool.pytest.ini_options]
testpaths = ["tests"]

[tool.ruff]
line-length = 100
target-version = "py311"

[tool.ruff.lint]
select = ["E", "F", "W", "I", "B", "UP", "SIM", "RUF"]
ignore = ["RUF001", "RUF002", "RUF003"]
isort.known-first-party = ["$pkg"]
"""

_INIT = '''\
"""$dist: an llmkit plugin.

It provides one $kind component. llmkit finds this module through the entry point declared
in pyproject.toml (``[project.entry-points.llmkit]``) and calls the hook below. The target
is a lazy ``"module:attr"`` string, so ``llmkit list`` never imports the component (or
torch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmkit import hookimpl

__version__ = "0.1.0"


@hookimpl
def register_components(register: Callable[..., Any]) -> None:
    register(
        "$kind",
        "$component",
        "$target",
        summary="$summary",$capabilities
    )
'''

_ATTENTION = '''\
"""The $kind component '$component'.

An attention *kernel*: the model's attention module owns the projections, the positional
scheme and the KV cache, and calls the kernel on per-head tensors. The contract
(``llmkit.contracts.AttentionKernel``, checked by the conformance suite):

- q (B, Hq, Tq, D); k and v (B, Hkv, Tk, D), Tk ≥ Tq; return (B, Hq, Tq, D) in q's dtype.
- Query i sits at key position Tk − Tq + i (bottom-right alignment, how a KV cache presents
  keys); with ``causal`` it sees keys up to that position.
- GQA: query head h reads key/value head h // (Hq / Hkv).
- ``bias`` (a DistanceBias or None) is added to the scores: ``bias.dense(Tq, Tk)``.
- ``key_padding_mask`` (B, Tk) is True where a key may be attended; a query left with no key
  at all returns zeros.
"""

from __future__ import annotations

import math

import torch
from llmkit.contracts import AttentionKernel, BuildContext, ComponentOptions, DistanceBias
from pydantic import Field
from torch import Tensor


class Options(ComponentOptions):
    """Options of this component (unknown keys in a spec are errors)."""

    softmax_scale: float | None = Field(
        None, gt=0.0, description="Multiplier of q·k before the softmax; unset = 1/sqrt(D)."
    )


class $cls(AttentionKernel):
    """``softmax(q kᵀ · scale + bias) v`` in plain PyTorch, computed in float32."""

    Options = Options

    def __init__(self, options: Options, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.softmax_scale = options.softmax_scale

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = True,
        bias: DistanceBias | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        hq, tq, d = q.shape[1], q.shape[2], q.shape[3]
        hkv, tk = k.shape[1], k.shape[2]
        k = k.repeat_interleave(hq // hkv, dim=1)  # (B, Hq, Tk, D)
        v = v.repeat_interleave(hq // hkv, dim=1)
        scale = self.softmax_scale or 1.0 / math.sqrt(d)
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, Hq, Tq, Tk)
        if bias is not None:
            scores = scores + bias.dense(tq, tk, causal=causal).to(scores.device)
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device)
        if causal:  # query i sits at key position tk - tq + i
            allowed = allowed.tril(diagonal=tk - tq)
        allowed = allowed[None, None]  # (1, 1, Tq, Tk)
        if key_padding_mask is not None:
            keys = key_padding_mask.to(device=q.device, dtype=torch.bool)
            allowed = allowed & keys[:, None, None, :]
        empty = ~allowed.any(dim=-1, keepdim=True)  # queries without any key
        scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0)
        probs = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)
        return (probs @ v.float()).to(q.dtype)
'''

_FFN = '''\
"""The $kind component '$component'.

A feed-forward block: ``(B, T, C) → (B, T, C)``, position-wise (no token sees another), in
the input's dtype. Built as ``$cls(options, ctx)``; ``ctx.features`` is the width it acts
on. A linear layer named ``out_proj`` gets GPT-2's scaled residual initialization.
"""

from __future__ import annotations

import torch.nn.functional as F
from llmkit.contracts import BuildContext, ComponentOptions
from pydantic import Field
from torch import Tensor, nn


class Options(ComponentOptions):
    """Options of this component (unknown keys in a spec are errors)."""

    multiplier: float = Field(
        4.0, gt=0.0, description="Hidden size as a multiple of the model width."
    )


class $cls(nn.Module):
    """``out_proj(gelu(in_proj(x)))``."""

    Options = Options

    def __init__(self, options: Options, ctx: BuildContext) -> None:
        super().__init__()
        width = ctx.features
        hidden = max(1, round(options.multiplier * width))
        self.in_proj = nn.Linear(width, hidden, bias=ctx.bias)
        self.out_proj = nn.Linear(hidden, width, bias=ctx.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_proj(F.gelu(self.in_proj(x)))
'''

_NORM = '''\
"""The $kind component '$component'.

A norm: ``(B, T, C) → (B, T, C)``, position-wise, in the input's dtype (compute in float32 and
cast back, so bfloat16 training stays accurate). Built as ``$cls(options, ctx)``;
``ctx.features`` is the width it normalizes.
"""

from __future__ import annotations

import torch
from llmkit.contracts import BuildContext, ComponentOptions
from pydantic import Field
from torch import Tensor, nn


class Options(ComponentOptions):
    """Options of this component (unknown keys in a spec are errors)."""

    eps: float = Field(1e-6, gt=0.0, description="Added to the mean square.")


class $cls(nn.Module):
    """``weight · x / sqrt(mean(x²) + eps)`` over the last dimension."""

    Options = Options

    def __init__(self, options: Options, ctx: BuildContext) -> None:
        super().__init__()
        self.eps = options.eps
        self.weight = nn.Parameter(torch.ones(ctx.features))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)
'''

_POSITION = '''\
"""The $kind component '$component'.

A positional scheme acts in the places it declares in ``acts_on`` (and in its registry
capabilities): ``embedding`` (``embed``: add to token embeddings), ``qk`` (``rotate``: change
q and k, scores must depend only on relative position) or ``score_bias`` (``score_bias``:
a DistanceBias). ``positions`` are absolute token positions, (T,) or (B, T); a KV cache
passes the positions of the new tokens only.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from llmkit.contracts import BuildContext, ComponentOptions, PositionalScheme
from pydantic import Field
from torch import Tensor


class Options(ComponentOptions):
    """Options of this component (unknown keys in a spec are errors)."""

    base: float = Field(10000.0, gt=1.0, description="Wavelength base of the frequencies.")


class $cls(PositionalScheme):
    """``x + [sin(p·f), cos(p·f)]`` with frequencies f = base^(−i/half)."""

    Options = Options
    acts_on: ClassVar[frozenset[str]] = frozenset({"embedding"})

    def __init__(self, options: Options, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.width = ctx.features
        half = self.width // 2
        freqs = options.base ** (-torch.arange(half, dtype=torch.float64) / max(half, 1))
        self.register_buffer("freqs", freqs.float(), persistent=False)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        angles = positions.to(self.freqs.device, torch.float32)[..., None] * self.freqs
        table = torch.cat([angles.sin(), angles.cos()], dim=-1)  # (..., T, 2·half)
        if table.shape[-1] < self.width:  # an odd width: the last feature gets nothing
            table = torch.nn.functional.pad(table, (0, self.width - table.shape[-1]))
        return x + table.to(x.dtype)
'''

_OPTIMIZER = '''\
"""The $kind component '$component'.

An optimizer factory: ``build(model, options) -> torch.optim.Optimizer``. The contract:
every trainable parameter in exactly one group (``llmkit.optim.param_groups_for`` splits
decay / no-decay), ``initial_lr`` on every group (``set_initial_lr``), the step reads
``group["lr"]`` every time (schedules set it), and everything the step depends on lives in
``self.state`` (so checkpoints restore it exactly).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from llmkit.optim import Beta, OptimizerOptions, param_groups_for, set_initial_lr
from pydantic import Field
from torch import Tensor, nn


class $cls(torch.optim.Optimizer):
    """SGD with heavy-ball momentum and decoupled weight decay."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(momentum).add_(p.grad)
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.add_(buf, alpha=-lr)
        return loss


class Options(OptimizerOptions):
    """Options of this optimizer (lr, weight_decay and the decay flags come from
    OptimizerOptions; unknown keys in a spec are errors)."""

    lr: float = Field(1e-2, gt=0, description="Peak learning rate (schedules scale it)")
    momentum: Beta = Field(0.9, description="Momentum coefficient")


def build(model: nn.Module, options: Options) -> torch.optim.Optimizer:
    """:class:`$cls` over the model's decay / no-decay parameter groups."""
    optimizer = $cls(
        param_groups_for(model, options),
        lr=options.lr,
        momentum=options.momentum,
        weight_decay=options.weight_decay,
    )
    return set_initial_lr(optimizer)
'''

_SCHEDULE = '''\
"""The $kind component '$component'.

A schedule factory: ``build(options, *, total_steps) -> (step -> factor)``. The trainer sets
every group's lr to ``initial_lr · factor(step)`` for 0-based steps. The contract: the factor
peaks at 1.0, is never negative (also past total_steps), does not rise over the last 20% of
steps, and is a pure function of the step (resuming a run must not change it); with
``warmup_steps`` it rises during warmup and reaches 1.0 at its end.
"""

from __future__ import annotations

from collections.abc import Callable

from llmkit.optim import WarmupOptions
from pydantic import Field


class Options(WarmupOptions):
    """Options of this schedule (warmup_steps comes from WarmupOptions)."""

    min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Final lr as a fraction of the base lr"
    )


def build(options: Options, *, total_steps: int) -> Callable[[int], float]:
    """Linear warmup to 1.0, then a linear decay to ``min_lr_ratio`` at ``total_steps``."""
    warmup, floor = options.warmup_steps, options.min_lr_ratio
    if not 0 <= warmup <= total_steps:
        raise ValueError(f"warmup_steps ({warmup}) exceeds total_steps ({total_steps})")
    span = max(total_steps - warmup, 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / span, 1.0)
        return floor + (1.0 - floor) * (1.0 - progress)

    return factor
'''

_COMPONENT = {
    "attention": _ATTENTION,
    "ffn": _FFN,
    "norm": _NORM,
    "position": _POSITION,
    "optimizer": _OPTIMIZER,
    "schedule": _SCHEDULE,
}

_TEST = '''\
"""The plugin's tests: llmkit's conformance suite over every component it registers, the
component in a spec (and a model), and the entry point that makes it a plugin."""

from __future__ import annotations

import importlib.metadata as md
import tomllib
from pathlib import Path

import pytest
from llmkit.registry import Registry
from llmkit.spec import load_spec_dict
from llmkit.testing import $testing_imports

import $pkg as plugin

DISTRIBUTION = "$dist"
ENTRY_POINT = "$ep"
KIND = "$kind"
COMPONENT = "$component"
ROOT = Path(__file__).resolve().parent.parent
MODEL = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 16}
SPEC = $spec_ref


def plugin_registry() -> Registry:
    """llmkit's built-in components plus this plugin's, registered from the source tree so
    the tests also run before the package is installed."""
    reg = Registry()
    reg.load_entry_points([])  # llmkit's built-in plugin only
    info = reg.add_plugin(plugin, ENTRY_POINT, DISTRIBUTION, plugin.__version__)
    assert info.error is None, info.error
    return reg


REGISTRY = plugin_registry()
PARAMS = [p for p in conformance_params(registry=REGISTRY) if p.values[0].provider == DISTRIBUTION]


def test_the_plugin_registers_its_components():
    assert [p.id for p in PARAMS] == [f"{KIND}.{COMPONENT}"]


@pytest.mark.parametrize("record", PARAMS)
def test_conforms(record):
    check_component(record)


def test_a_spec_can_use_it():
    resolved = load_spec_dict(SPEC, registry=REGISTRY)
    assert resolved.to_dict()
$in_a_model

def test_pyproject_declares_the_entry_point():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert meta["project"]["entry-points"]["llmkit"][ENTRY_POINT] == plugin.__name__


def test_the_installed_entry_point_loads_it():
    if not [e for e in md.entry_points(group="llmkit") if e.name == ENTRY_POINT]:
        pytest.skip("not installed (pip install -e .)")
    reg = Registry()
    reg.load_entry_points([ENTRY_POINT])
    assert reg.plugins[ENTRY_POINT].error is None, reg.plugins[ENTRY_POINT].error
    assert reg.get(KIND, COMPONENT).provider == DISTRIBUTION
'''

_README = """\
# $dist

An llmkit plugin providing the **$kind** component `$component`:
$summary.

## Install and test

```bash
pip install -e .            # registers the `$ep` entry point in the `llmkit` group
pytest                      # llmkit's conformance suite over the component, and more
llmkit plugins              # `$ep` is listed with what it registered
llmkit show $kind $component
```

## Use it in a spec

```toml
requires = ["$dist>=0.1"]   # a clear error if the plugin is missing

$spec_toml
```

## Develop it

- `$pkg/__init__.py` registers the component through the `register_components` hook;
  the target is a lazy `"module:attr"` string, so `llmkit list` stays fast.
- `$pkg/$module.py` holds the component and its pydantic `Options` (unknown keys are
  rejected, so a misspelled option in a spec is an error).
- `tests/test_$pkg.py` runs `llmkit.testing.check_component` (shapes, dtypes, gradients,
  causality, determinism, KV-cache decoding...) on every component this plugin registers.
  Keep it green as you replace the starting-point implementation with your own.

llmkit's `docs/plugins/` describe the hooks, every kind's contract and the capabilities the
core reads.
"""
