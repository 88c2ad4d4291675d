"""The conformance suite (llmkit.testing) over every registered component, and proof that it
fails on components that break the contracts."""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
import torch
from pydantic import BaseModel, Field, model_validator
from torch import Tensor, nn

from llmkit.components import builtin
from llmkit.contracts import (
    AttentionKernel,
    BuildContext,
    ComponentOptions,
    NoOptions,
    PositionalScheme,
)
from llmkit.errors import SpecError
from llmkit.hookspecs import hookimpl
from llmkit.optim import OptimizerOptions, WarmupOptions, param_groups_for, set_initial_lr
from llmkit.registry import Registry, get_registry
from llmkit.testing import (
    check_component,
    check_model_combination,
    conformance_params,
    reference_attention,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one thread is faster, and immune to OpenMP contention on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- every registered component -------------------------------------------------------------


@pytest.mark.parametrize("record", conformance_params())
def test_component_conforms(record):
    check_component(record)


# Option sets that exercise code paths the defaults do not reach.
BUILTIN_VARIANTS = [
    ("attention", "sliding_window", {"window": 1}),
    ("attention", "sliding_window", {"window": 3}),
    ("attention", "sliding_window", {"window": 40}),  # several query chunks
    ("attention", "dense", {"dropout": 0.1}),
    ("attention", "sdpa", {"dropout": 0.1}),
    ("position", "rope", {"rotary_fraction": 0.5}),
    ("position", "rope", {"scaling": "ntk", "scaling_factor": 4.0}),
    ("position", "rope", {"scaling": "linear", "scaling_factor": 2.0}),
    ("position", "sinusoidal", {"base": 100.0}),
    *[("ffn", "mlp", {"activation": a}) for a in ("gelu_tanh", "relu", "relu2", "silu")],
    ("ffn", "swiglu", {"bias": False, "multiple_of": 16}),
    ("ffn", "geglu", {"approximate": "tanh", "hidden": 24}),
    ("norm", "layernorm", {"bias": False}),
    ("optimizer", "sgd", {"nesterov": True}),
    ("optimizer", "adamw", {"weight_decay": 0.1}),
    ("schedule", "wsd", {"decay_shape": "cosine"}),
    ("schedule", "inverse_sqrt", {"timescale": 5}),
    ("schedule", "cosine", {"min_lr_ratio": 0.0}),
]


@pytest.mark.parametrize(
    ("kind", "name", "options"),
    BUILTIN_VARIANTS,
    ids=[f"{k}.{n}-{'-'.join(f'{a}={b}' for a, b in o.items())}" for k, n, o in BUILTIN_VARIANTS],
)
def test_builtin_variant_conforms(kind, name, options):
    check_component(get_registry().get(kind, name), options)


def test_conformance_params_ids_cover_the_registry():
    reg = get_registry()
    ids = [p.id for p in conformance_params(registry=reg)]
    assert ids == [c.key for c in reg.list()]
    norms = [p.id for p in conformance_params("norm", registry=reg)]
    assert {"norm.layernorm", "norm.rmsnorm"} <= set(norms)
    assert all(i.startswith("norm.") for i in norms)


# -- fake plugins -----------------------------------------------------------------------------


def fake_registry(*components: dict[str, Any]) -> Registry:
    """A fresh registry: the built-in plugin, then a fake plugin registering ``components``
    (each the keyword arguments of ``register``) and a kind of its own, ``widget``."""

    class FakePlugin:
        @hookimpl
        def register_kinds(self, register):
            register("widget", "A kind only the fake plugin knows")

        @hookimpl
        def register_components(self, register):
            for c in components:
                c = dict(c)
                register(c.pop("kind"), c.pop("name"), c.pop("target"), **c)

    reg = Registry()
    reg.add_plugin(builtin, "builtin", "llmkit", "0")
    info = reg.add_plugin(FakePlugin(), "fake", "llmkit-fake", "0.0.1")
    assert info.error is None, info.error
    return reg


def fake(kind: str, target: Any, **extra: Any):
    """Register ``target`` as ``kind.fake`` in a fresh registry and return its record."""
    reg = fake_registry({"kind": kind, "name": "fake", "target": target, **extra})
    return reg.get(kind, "fake")


def test_fake_plugin_components_join_the_suite():
    reg = fake_registry(
        {"kind": "widget", "name": "gizmo", "target": lambda: None, "options": NoOptions},
        {"kind": "ffn", "name": "mixer", "target": MixingFFN},
    )
    ids = [p.id for p in conformance_params(registry=reg)]
    assert "widget.gizmo" in ids and "ffn.mixer" in ids and "attention.sdpa" in ids
    params = {p.id: p.values[0] for p in conformance_params(registry=reg)}
    assert params["ffn.mixer"].provider == "llmkit-fake"
    check_component(params["widget.gizmo"])  # unknown kinds: options and a callable target
    with pytest.raises(AssertionError, match="mixes positions"):
        check_component(params["ffn.mixer"])


def test_requires_cuda_is_skipped_without_a_gpu():
    reg = fake_registry(
        {
            "kind": "ffn",
            "name": "gpu_only",
            "target": GoodFFN,
            "capabilities": {"requires": ["cuda"]},
        }
    )
    (param,) = [p for p in conformance_params("ffn", registry=reg) if p.id == "ffn.gpu_only"]
    assert bool(param.marks) == (not torch.cuda.is_available())


# -- broken attention kernels -----------------------------------------------------------------


class _Kernel(AttentionKernel):
    Options = NoOptions

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return reference_attention(
            q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask
        )


class GoodAttention(_Kernel):
    """The reference itself: passes."""


class PeekingAttention(_Kernel):
    """Ignores the causal flag: every query sees the future."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return super().forward(q, k, v, causal=False, bias=bias, key_padding_mask=key_padding_mask)


class TopLeftAttention(_Kernel):
    """Aligns queries top-left (query i sees keys 0..i), wrong when Tq < Tk."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        tq = q.shape[2]
        if causal and tq < k.shape[2]:
            mask = None if key_padding_mask is None else key_padding_mask[:, :tq]
            return super().forward(q, k[:, :, :tq], v[:, :, :tq], bias=bias, key_padding_mask=mask)
        return super().forward(q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask)


class TiledGQAAttention(_Kernel):
    """Query head h reads kv head h % Hkv (tile) instead of h // (Hq/Hkv)."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        return super().forward(q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask)


class BiasIgnoringAttention(_Kernel):
    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return super().forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask)


class PaddingIgnoringAttention(_Kernel):
    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return super().forward(q, k, v, causal=causal, bias=bias)


class NoisyAttention(_Kernel):
    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        out = super().forward(q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask)
        return out + 1e-3 * torch.randn_like(out)


class FalseWindowAttention(_Kernel):
    """Declares a cache window of 4 but attends every key."""

    cache_window = 4


class SilentCausalOnlyAttention(_Kernel):
    """Declares causal_only but quietly computes causal attention for causal=False."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return super().forward(q, k, v, bias=bias, key_padding_mask=key_padding_mask)


class UnscaledAttention(_Kernel):
    """Forgets the 1/√d scale: only the comparison with the reference notices."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        q = q * q.shape[-1] ** 0.5
        return super().forward(q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask)


class FloatAttention(_Kernel):
    """Returns float32 whatever the input dtype."""

    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        return super().forward(
            q.float(),
            k.float(),
            v.float(),
            causal=causal,
            bias=bias,
            key_padding_mask=key_padding_mask,
        )


class ParamAttention(_Kernel):
    """Has a parameter that never enters the output."""

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.temperature = nn.Parameter(torch.ones(()))


class _NonCausalBackward(torch.autograd.Function):
    """Causal forward, but a backward computed as if non-causal."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return reference_attention(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
            return torch.autograd.grad(reference_attention(q, k, v, causal=False), (q, k, v), grad)


class LeakyBackwardAttention(_Kernel):
    def forward(self, q, k, v, *, causal=True, bias=None, key_padding_mask=None):
        if causal and bias is None and key_padding_mask is None and q.shape[2] == k.shape[2]:
            return _NonCausalBackward.apply(q, k, v)
        return super().forward(q, k, v, causal=causal, bias=bias, key_padding_mask=key_padding_mask)


APPROX = {"approximate": True}  # skip the reference comparison so the targeted check fires


@pytest.mark.parametrize(
    ("target", "capabilities", "match"),
    [
        (PeekingAttention, APPROX, "not causal"),
        (TopLeftAttention, APPROX, "bottom-right"),
        (TiledGQAAttention, APPROX, r"kv head h // 2"),
        (BiasIgnoringAttention, APPROX, "bias is ignored"),
        (PaddingIgnoringAttention, APPROX, "key_padding_mask"),
        (NoisyAttention, APPROX, "not deterministic"),
        (FalseWindowAttention, APPROX, "cache_window is 4"),
        (SilentCausalOnlyAttention, {**APPROX, "causal_only": True}, "causal_only"),
        (UnscaledAttention, {}, "differs from reference_attention"),
        (FloatAttention, {}, "dtype torch.float32"),
        (ParamAttention, {}, "no gradient reaches parameter 'temperature'"),
        (LeakyBackwardAttention, {}, "the gradient of q differs from reference_attention"),
        (LeakyBackwardAttention, APPROX, "backward is not causal"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else None,
)
def test_broken_attention_fails(target, capabilities, match):
    with pytest.raises(AssertionError, match=match):
        check_component(fake("attention", target, capabilities=capabilities))


def test_good_fakes_pass():
    check_component(fake("attention", GoodAttention))
    check_component(fake("attention", GoodAttention, capabilities={"gqa": False}))
    check_component(fake("ffn", GoodFFN))
    check_component(fake("position", ShiftPosition, capabilities={"acts_on": ["qk"]}))
    check_component(fake("optimizer", build_sign_sgd, options=OptimizerOptions))
    check_component(fake("schedule", build_linear_warmup, options=WarmupOptions))
    check_component(fake("widget", lambda: None, options=NoOptions))


# -- broken ffn / norm ------------------------------------------------------------------------


class _Pointwise(nn.Module):
    Options = NoOptions

    def __init__(self, options: Any, ctx: BuildContext) -> None:
        super().__init__()
        self.proj = nn.Linear(ctx.d_model, ctx.d_model)


class GoodFFN(_Pointwise):
    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.proj(x))


class MixingFFN(_Pointwise):
    """Leaks information across positions through a running sum."""

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x.cumsum(dim=1))


class BatchMixingFFN(_Pointwise):
    """Normalizes over the batch: rows influence each other."""

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x - x.mean(dim=0, keepdim=True))


class UnusedParamFFN(_Pointwise):
    def __init__(self, options: Any, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.gate = nn.Linear(ctx.d_model, ctx.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class DropoutInEvalFFN(_Pointwise):
    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.dropout(self.proj(x), 0.5, training=True)


class InPlaceFFN(_Pointwise):
    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x.mul_(2.0))


class Float32Norm(_Pointwise):
    """Computes in float32 and forgets to cast back."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.proj(x).float()
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


class ShapeChangingFFN(_Pointwise):
    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)[..., :-1]


@pytest.mark.parametrize(
    ("kind", "target", "match"),
    [
        ("ffn", MixingFFN, "mixes positions"),
        ("ffn", BatchMixingFFN, "mixes positions"),
        ("ffn", UnusedParamFFN, "no gradient reaches parameter 'gate.weight'"),
        ("ffn", DropoutInEvalFFN, "not deterministic"),
        ("ffn", InPlaceFFN, "in place"),
        ("ffn", ShapeChangingFFN, "shape"),
        ("norm", Float32Norm, "dtype torch.float32"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else x,
)
def test_broken_pointwise_fails(kind, target, match):
    with pytest.raises(AssertionError, match=match):
        check_component(fake(kind, target))


def test_position_wise_false_skips_only_the_mixing_check():
    check_component(fake("ffn", MixingFFN, capabilities={"position_wise": False}))
    with pytest.raises(AssertionError, match="no gradient"):
        check_component(fake("ffn", UnusedParamFFN, capabilities={"position_wise": False}))


# -- broken positional schemes ----------------------------------------------------------------


class _Position(PositionalScheme):
    Options = NoOptions


class ShiftPosition(_Position):
    """A correct relative scheme: rotates feature pairs by an angle ∝ position (RoPE-like)."""

    acts_on: ClassVar[frozenset[str]] = frozenset({"qk"})

    def rotate(self, q, k, positions):
        return self._rot(q, positions), self._rot(k, positions)

    @staticmethod
    def _rot(x, positions):
        h = x.shape[-1] // 2
        angle = positions.float()[..., None] * 0.3  # (T, 1) or (B, T, 1)
        if angle.dim() == 3:
            angle = angle[:, None]
        x1, x2 = x[..., :h].float(), x[..., h:].float()
        cos, sin = angle.cos(), angle.sin()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype)


class MislabelledPosition(ShiftPosition):
    """Its class says qk; the registration below says embedding."""


class AbsoluteQKPosition(_Position):
    """Scales q/k by their absolute position: scores depend on where, not how far."""

    acts_on: ClassVar[frozenset[str]] = frozenset({"qk"})

    def rotate(self, q, k, positions):
        scale = (1.0 + positions.float() / 10.0)[..., None]
        if scale.dim() == 3:
            scale = scale[:, None]
        return (q * scale).to(q.dtype), (k * scale).to(k.dtype)


class SneakyEmbedPosition(ShiftPosition):
    """Declares only qk but also changes the embeddings."""

    def embed(self, x, positions):
        return x + 0.1


class ConstantEmbedPosition(_Position):
    """Declares embedding but adds the same vector at every position."""

    acts_on: ClassVar[frozenset[str]] = frozenset({"embedding"})

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.vec = nn.Parameter(torch.randn(ctx.d_model) * 0.02)

    def embed(self, x, positions):
        return x + self.vec.to(x.dtype)


class WrongBiasPosition(_Position):
    """Declares score_bias but returns a plain tensor."""

    acts_on: ClassVar[frozenset[str]] = frozenset({"score_bias"})

    def score_bias(self):
        return torch.zeros(self.ctx.n_heads)


class NoBatchPositions(ShiftPosition):
    """Ignores per-row (B, T) positions, using the first row for all."""

    def rotate(self, q, k, positions):
        if positions.dim() == 2:
            positions = positions[0]
        return super().rotate(q, k, positions)


class AbsoluteIndexPosition(_Position):
    """Embeds with ``arange(T)`` instead of the positions it is given: wrong for a KV cache."""

    acts_on: ClassVar[frozenset[str]] = frozenset({"embedding"})

    def embed(self, x, positions):
        t = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        return x + torch.sin(t)[:, None].to(x.dtype)


@pytest.mark.parametrize(
    ("target", "acts_on", "match"),
    [
        (MislabelledPosition, ["embedding"], "acts_on"),
        (AbsoluteQKPosition, ["qk"], "relative position"),
        (SneakyEmbedPosition, ["qk"], "acts_on lacks 'embedding'"),
        (ConstantEmbedPosition, ["embedding"], "same token at every position"),
        (WrongBiasPosition, ["score_bias"], "not a DistanceBias"),
        (NoBatchPositions, ["qk"], r"\(B, T\) positions"),
        (AbsoluteIndexPosition, ["embedding"], "one token at position"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else None,
)
def test_broken_position_fails(target, acts_on, match):
    with pytest.raises(AssertionError, match=match):
        check_component(fake("position", target, capabilities={"acts_on": acts_on}))


# -- broken optimizers ------------------------------------------------------------------------


class _SignSGD(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class _Inert(_SignSGD):
    @torch.no_grad()
    def step(self, closure=None):
        return None


class _FixedLR(_SignSGD):
    """Reads the lr it was built with, ignoring what a schedule sets."""

    def __init__(self, params, lr):
        super().__init__(params, lr)
        self.fixed_lr = lr

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-self.fixed_lr)


class _Ascending(_SignSGD):
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=group["lr"])


class _Stateful(_SignSGD):
    """Keeps a step counter outside the optimizer state: lost by state_dict round trips."""

    def __init__(self, params, lr):
        super().__init__(params, lr)
        self.count = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.count += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"] * (1 + 0.1 * (self.count % 3)))


def build_sign_sgd(model, options):
    return set_initial_lr(_SignSGD(param_groups_for(model, options), options.lr))


def build_inert(model, options):
    return set_initial_lr(_Inert(param_groups_for(model, options), options.lr))


def build_without_initial_lr(model, options):
    return _SignSGD(param_groups_for(model, options), options.lr)


def build_fixed_lr(model, options):
    return set_initial_lr(_FixedLR(param_groups_for(model, options), options.lr))


def build_stateful(model, options):
    return set_initial_lr(_Stateful(param_groups_for(model, options), options.lr))


def build_partial(model, options):
    params = [p for n, p in model.named_parameters() if not n.startswith("norm")]
    return set_initial_lr(_SignSGD(params, options.lr))


def build_ascending(model, options):
    return set_initial_lr(_Ascending(param_groups_for(model, options), options.lr))


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (build_inert, "regression loss"),
        (build_ascending, "regression loss"),
        (build_without_initial_lr, "initial_lr"),
        (build_fixed_lr, r"group\['lr'\]"),
        (build_stateful, "load_state_dict"),
        (build_partial, "missing from every group"),
    ],
    ids=lambda x: x.__name__ if callable(x) else None,
)
def test_broken_optimizer_fails(target, match):
    with pytest.raises(AssertionError, match=match):
        check_component(fake("optimizer", target, options=OptimizerOptions))


# -- broken schedules -------------------------------------------------------------------------


def _warm(step: int, warmup: int) -> float:
    return (step + 1) / warmup if step < warmup else 1.0


def build_linear_warmup(options, *, total_steps):
    return lambda step: _warm(step, options.warmup_steps)


def build_rising_tail(options, *, total_steps):
    def factor(step):
        if step < options.warmup_steps:
            return _warm(step, options.warmup_steps)
        return 0.5 + 0.5 * abs(step - 0.8 * total_steps) / total_steps

    return factor


def build_negative(options, *, total_steps):
    return lambda step: _warm(step, options.warmup_steps) - 1.5 * step / total_steps


def build_half_peak(options, *, total_steps):
    return lambda step: 0.5 * _warm(step, options.warmup_steps)


def build_counting(options, *, total_steps):
    calls = itertools.count()
    return lambda step: 1.0 / (1.0 + next(calls) / 1000)


def build_no_warmup(options, *, total_steps):
    return lambda step: 1.0


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (build_rising_tail, "increases"),
        (build_negative, "negative"),
        (build_half_peak, "peak"),
        (build_counting, "call order"),
        (build_no_warmup, "does not rise during 10 warmup steps"),
    ],
    ids=lambda x: x.__name__ if callable(x) else None,
)
def test_broken_schedule_fails(target, match):
    with pytest.raises(AssertionError, match=match):
        check_component(fake("schedule", target, options=WarmupOptions))


# -- other kinds ------------------------------------------------------------------------------


class NeedsPath(ComponentOptions):
    path: str = Field(description="required")


class LaxOptions(BaseModel):
    """Silently accepts unknown keys."""

    size: int = 1


class NeverValid(ComponentOptions):
    size: int = 1

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError("never valid")


def test_unknown_kind_checks_options_and_target():
    # required options (a dataset's paths) are fine without options; validated when given
    check_component(fake("widget", lambda: None, options=NeedsPath))
    check_component(fake("widget", lambda: None, options=NeedsPath), {"path": "x"})
    with pytest.raises(AssertionError, match="do not validate"):
        check_component(fake("widget", lambda: None, options=NeedsPath), {"path": 3.5})
    with pytest.raises(AssertionError, match="default options do not validate"):
        check_component(fake("widget", lambda: None, options=NeverValid))
    with pytest.raises(AssertionError, match="accepts unknown keys"):
        check_component(fake("widget", lambda: None, options=LaxOptions))
    with pytest.raises(AssertionError, match="accepts unknown keys"):
        check_component(fake("ffn", GoodFFN, options=LaxOptions))
    with pytest.raises(AssertionError, match="not callable"):
        check_component(fake("widget", 42, options=NoOptions))
    with pytest.raises(AssertionError, match="failed to import"):
        check_component(fake("widget", "llmkit.no_such_module:thing", options=NoOptions))


def test_unbuildable_component_is_an_assertion_not_a_crash():
    class Crashing(_Pointwise):
        def __init__(self, options, ctx):
            raise RuntimeError("boom")

    with pytest.raises(AssertionError, match=r"building it .* raised RuntimeError: boom"):
        check_component(fake("ffn", Crashing))


# -- whole models with fake parts --------------------------------------------------------------


def test_model_check_catches_a_peeking_kernel():
    reg = fake_registry(
        {
            "kind": "attention",
            "name": "peek",
            "target": PeekingAttention,
            "capabilities": {"kv_cache": True},
        }
    )
    with pytest.raises(AssertionError, match="not causal"):
        check_model_combination("peek", "learned", "mlp", "layernorm", registry=reg)


def test_model_check_catches_a_kernel_that_breaks_kv_cache_decoding():
    reg = fake_registry(
        {
            "kind": "attention",
            "name": "topleft",
            "target": TopLeftAttention,
            "capabilities": {"kv_cache": True},
        }
    )
    with pytest.raises(AssertionError, match="KV-cache decoding"):
        check_model_combination("topleft", "learned", "mlp", "rmsnorm", registry=reg)
    # without the kv_cache capability the cache is not exercised, and the rest is fine
    reg = fake_registry({"kind": "attention", "name": "topleft", "target": TopLeftAttention})
    check_model_combination("topleft", "learned", "mlp", "rmsnorm", registry=reg)


def test_model_check_lets_spec_errors_through():
    reg = fake_registry(
        {
            "kind": "attention",
            "name": "plain",
            "target": GoodAttention,
            "capabilities": {"positions": ["embedding"], "gqa": False},
        }
    )
    with pytest.raises(SpecError, match=r"'plain'.*'alibi'|'alibi'.*'plain'"):
        check_model_combination("plain", "alibi", "mlp", "layernorm", registry=reg)
    # gqa = false: the check picks n_kv_heads = n_heads by itself
    model = check_model_combination("plain", "learned", "mlp", "layernorm", registry=reg)
    assert model.config.kv_heads == model.config.n_heads
    with pytest.raises(SpecError, match="n_kv_heads"):
        check_model_combination(
            "plain", "learned", "mlp", "layernorm", registry=reg, model={"n_kv_heads": 2}
        )
