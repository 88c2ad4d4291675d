"""Mixture-of-experts feed-forward block: a router sends each token to ``top_k`` of
``num_experts`` expert FFNs and mixes their outputs with the router's weights.

Sources: the sparsely-gated MoE layer and its load-balancing idea (Shazeer et al. 2017,
"Outrageously Large Neural Networks"); top-2 gating with expert capacity, token dropping and
the auxiliary loss ``E·Σ f_i·P_i`` (GShard, Lepikhin et al. 2020); top-1 routing, capacity
factor and router jitter (Switch Transformer, Fedus et al. 2021); the router z-loss
(ST-MoE, Zoph et al. 2022); always-applied shared experts (DeepSeekMoE, Dai et al. 2024);
top-2 of 8 SwiGLU experts with top-k-then-softmax weights and no token dropping (Mixtral,
Jiang et al. 2024).

**Dispatch.** The router runs in float32. Every (token, choice) assignment is listed
choice-major (all first choices, then all second choices, ...), stably sorted by expert id,
and cut into one contiguous segment per expert; each expert runs once on its segment (a
plain matmul on the gathered rows) and the weighted results are scattered back to their
(choice, token) slots and summed over the choices. Work and memory are proportional to
tokens × top_k, never tokens × num_experts; the host synchronises once per call to read the
per-expert counts (the segment lengths), and once more with a capacity (the kept mask).

**Capacity.** With a capacity factor ``c`` an expert takes at most
``ceil(c · tokens · top_k / num_experts)`` assignments per call (tokens = B·T); the sorted
order gives first choices priority over second choices, then earlier tokens over later ones
(GShard). A dropped assignment contributes nothing (the residual carries the token). By
default nothing is dropped (``capacity_factor = None``, Mixtral); capacity applies in
training only unless ``eval_capacity_factor`` is set, so in evaluation and generation the
block is exactly position-wise and KV-cache decoding equals a full forward.

**Side outputs** (through :class:`~llmkit.contracts.SideOutputs`; the model prefixes
them with the module path, e.g. ``layers.1.ffn.load_balance``):

- losses: ``load_balance`` = load_balance_coef · E · Σ_i f_i · P_i with f_i the fraction of
  assignments routed to expert i (before dropping; Σ f_i = 1, so a perfectly balanced
  router scores 1 for any top_k) and P_i the mean router probability of expert i;
  ``z_loss`` = z_loss_coef · mean over tokens of logsumexp(logits)². A loss whose
  coefficient is 0 is not reported.
- metrics (detached tensors, no host sync): ``expert_load_max``, ``expert_load_min`` (the
  largest and smallest f_i; 1/E when balanced), ``expert_load_cv`` (std/mean of f_i; 0 when
  balanced), ``dropped_fraction`` (assignments dropped by capacity), ``router_entropy``
  (mean entropy of the router distribution, nats; ln E when uniform). With
  ``load_metrics = "per_expert"`` also ``expert_load.<i>`` for every expert.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator
from torch import Tensor, nn

from llmkit.components.ffn.geglu import GeGLU, GeGLUOptions
from llmkit.components.ffn.mlp import ACTIVATIONS, MLP, MLPOptions
from llmkit.components.ffn.swiglu import SwiGLU, SwiGLUOptions
from llmkit.contracts import BuildContext, ComponentOptions, SideOutputs, ffn_hidden

# -- options ----------------------------------------------------------------------------------


class MLPExpert(MLPOptions):
    """An ``mlp`` expert: ``out(act(in(x)))`` with the mlp component's options."""

    name: Literal["mlp"] = "mlp"


class SwiGLUExpert(SwiGLUOptions):
    """A ``swiglu`` expert: ``out(silu(gate(x)) * up(x))`` with the swiglu component's options."""

    name: Literal["swiglu"] = "swiglu"


class GeGLUExpert(GeGLUOptions):
    """A ``geglu`` expert: ``out(gelu(gate(x)) * up(x))`` with the geglu component's options."""

    name: Literal["geglu"] = "geglu"


ExpertOptions = Annotated[MLPExpert | SwiGLUExpert | GeGLUExpert, Field(discriminator="name")]

#: The block class of each expert kind (used for the shared expert).
EXPERT_BLOCKS: dict[str, type[nn.Module]] = {"mlp": MLP, "swiglu": SwiGLU, "geglu": GeGLU}


class MoEOptions(ComponentOptions):
    """Options of the mixture-of-experts block."""

    num_experts: int = Field(8, ge=1, description="Routed experts E.")
    top_k: int = Field(2, ge=1, description="Experts each token is sent to (k ≤ E).")
    routing: Literal["topk_softmax", "softmax_topk"] = Field(
        "topk_softmax",
        description="topk_softmax: softmax over the k largest logits, weights sum to 1 "
        "(Mixtral); softmax_topk: the k largest probabilities of a softmax over all experts, "
        "not renormalized (Switch, GShard-style, DeepSeekMoE). Use softmax_topk with top_k = 1, "
        "or the router gets no gradient from the LM loss.",
    )
    expert: ExpertOptions = Field(
        default_factory=SwiGLUExpert,
        description="Each expert: { name = 'mlp' | 'swiglu' | 'geglu', <that ffn's options> } "
        "(e.g. activation, hidden); a bare name is accepted; name defaults to swiglu.",
    )
    shared_experts: int = Field(
        0,
        ge=0,
        description="Experts applied to every token with weight 1, besides the routed ones "
        "(DeepSeekMoE). Built as one block of the expert kind with shared_experts× the hidden "
        "size (the same function as that many separate experts).",
    )
    shared_hidden: int | None = Field(
        None, ge=1, description="Total hidden size of the shared block; default shared_experts·h."
    )
    capacity_factor: float | None = Field(
        None,
        gt=0,
        description="Training: each expert takes at most ceil(c·tokens·top_k/E) assignments "
        "per call, the rest are dropped (Switch: 1.25); none = no dropping.",
    )
    eval_capacity_factor: float | None = Field(
        None,
        gt=0,
        description="The same in eval mode; none (default) keeps evaluation and generation "
        "dropless and exactly position-wise.",
    )
    jitter: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Training only: multiply the router input by U(1-jitter, 1+jitter) "
        "(Switch: 0.01).",
    )
    router_bias: bool = Field(False, description="A bias on the router's logits.")
    load_balance_coef: float = Field(
        0.01, ge=0.0, description="Coefficient of the load-balancing loss E·Σ f_i·P_i."
    )
    z_loss_coef: float = Field(
        0.001, ge=0.0, description="Coefficient of the router z-loss mean(logsumexp(logits)²)."
    )
    load_metrics: Literal["summary", "per_expert"] = Field(
        "summary",
        description="summary: expert_load_max/min/cv; per_expert: also expert_load.<i>.",
    )

    @field_validator("expert", mode="before")
    @classmethod
    def _expert_name(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"name": value}
        if isinstance(value, dict) and "name" not in value:
            return {"name": "swiglu", **value}
        return value

    @model_validator(mode="after")
    def _k_le_e(self) -> MoEOptions:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})"
            )
        if self.shared_hidden is not None and self.shared_experts == 0:
            raise ValueError("shared_hidden is set but shared_experts is 0")
        return self


# -- module -----------------------------------------------------------------------------------


class Router(nn.Module):
    """The gate: float32 logits ``x Wᵀ + b`` (E outputs), whatever the model's dtype or
    autocast. Deliberately not an ``nn.Linear``, so whole-model passes over linear layers
    (int8 quantization, say) leave routing decisions alone; ``weight``/``bias`` keep the
    names and layout of one."""

    def __init__(self, d: int, num_experts: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.float()
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float(), bias)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]} -> {self.weight.shape[0]} experts, float32"


class MoE(SideOutputs, nn.Module):
    """Top-k routed mixture of experts with optional shared experts (see the module doc).

    Parameters, one tensor per kind for all experts (``nn.Linear`` layout per expert):
    ``router.weight`` (E, C) of a :class:`Router`; ``w_in`` (E, H_in, C) with H_in = h for
    mlp experts and 2h for gated ones (rows [0, h) gate, [h, 2h) up); ``w_out`` (E, C, h);
    with biases, ``b_in`` (E·H_in,) and ``b_out`` (E·C,), flattened so that optimizers treat
    them as biases (1-D: no weight decay, never a Muon matrix). ``shared`` is an ordinary
    ffn block.
    """

    Options = MoEOptions

    def __init__(self, options: MoEOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        self.n_layers = ctx.n_layers
        e = options.expert
        d = ctx.features
        self.num_experts, self.top_k = options.num_experts, options.top_k
        self.hidden = ffn_hidden(d, e.hidden, e.multiplier, e.multiple_of)
        self.gated = e.name != "mlp"
        if e.name == "mlp":
            self.act: Callable[[Tensor], Tensor] = ACTIVATIONS[e.activation]
        elif e.name == "swiglu":
            self.act = F.silu
        else:
            self.act = functools.partial(F.gelu, approximate=e.approximate)
        bias = ctx.bias if e.bias is None else e.bias
        E, h_in = options.num_experts, self.hidden * (2 if self.gated else 1)
        self.router = Router(d, E, options.router_bias)
        self.w_in = nn.Parameter(torch.empty(E, h_in, d))
        self.w_out = nn.Parameter(torch.empty(E, d, self.hidden))
        self.b_in = nn.Parameter(torch.zeros(E * h_in)) if bias else None
        self.b_out = nn.Parameter(torch.zeros(E * d)) if bias else None
        self.shared: nn.Module | None = None
        if options.shared_experts:
            width = options.shared_hidden or options.shared_experts * self.hidden
            self.shared = EXPERT_BLOCKS[e.name](e.model_copy(update={"hidden": width}), ctx)
        self.init_weights(0.02)

    # -- init and accounting ------------------------------------------------------------------
    def init_weights(self, std: float, residual_std: float | None = None) -> None:
        """Normal(0, std) weights and zero biases like the rest of the model; output
        projections (``w_out``, the shared block's ``out_proj``) use ``residual_std``, by
        default std/√(2·n_layers) (GPT-2's scaled residual init)."""
        if residual_std is None:
            residual_std = std / math.sqrt(2 * max(self.n_layers, 1))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.ndim < 2 or name.endswith(".bias"):
                    nn.init.zeros_(p)
                elif name == "w_out" or name.endswith("out_proj.weight"):
                    nn.init.normal_(p, 0.0, residual_std)
                else:
                    nn.init.normal_(p, 0.0, std)

    def active_parameters(self) -> int:
        """Parameters used per token: the router, top_k routed experts, the shared block."""
        E = self.num_experts
        routed = sum(
            p.numel() for p in (self.w_in, self.w_out, self.b_in, self.b_out) if p is not None
        )
        other = sum(p.numel() for p in self.router.parameters())
        if self.shared is not None:
            other += sum(p.numel() for p in self.shared.parameters())
        return other + routed // E * self.top_k

    def extra_repr(self) -> str:
        o = self.options
        return (
            f"experts={o.num_experts}, top_k={o.top_k}, expert={o.expert.name}, "
            f"hidden={self.hidden}, routing={o.routing}, shared={o.shared_experts}, "
            f"capacity_factor={o.capacity_factor}"
        )

    # -- forward ------------------------------------------------------------------------------
    def capacity(self, n_tokens: int) -> int | None:
        """Assignments an expert may take in a call over ``n_tokens`` tokens (None: all)."""
        o = self.options
        factor = o.capacity_factor if self.training else o.eval_capacity_factor
        if factor is None:
            return None
        return max(1, math.ceil(factor * n_tokens * self.top_k / self.num_experts))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router logits (N, E) in float32, expert ids (N, k) and weights (N, k) for
        tokens ``x`` (N, C)."""
        o = self.options
        inp = x
        if self.training and o.jitter > 0:
            noise = torch.empty_like(x).uniform_(1.0 - o.jitter, 1.0 + o.jitter)
            inp = x * noise
        logits = self.router(inp)
        if o.routing == "topk_softmax":
            top, experts = logits.topk(self.top_k, dim=-1)
            weights = top.softmax(dim=-1)
        else:
            weights, experts = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
        return logits, experts, weights

    def expert_weights(self) -> list[tuple[Tensor, Tensor | None, Tensor, Tensor | None]]:
        """``(w_in, b_in, w_out, b_out)`` of every expert, as views. ``unbind`` makes the
        backward one stack of per-expert gradients; indexing ``w_in[e]`` would instead add a
        full-size zero gradient per expert (E² work)."""
        E = self.num_experts
        none: list[Tensor | None] = [None] * E
        b_in = none if self.b_in is None else list(self.b_in.view(E, -1).unbind(0))
        b_out = none if self.b_out is None else list(self.b_out.view(E, -1).unbind(0))
        return list(zip(self.w_in.unbind(0), b_in, self.w_out.unbind(0), b_out, strict=True))

    def expert_forward(
        self, x: Tensor, weights: tuple[Tensor, Tensor | None, Tensor, Tensor | None]
    ) -> Tensor:
        """One expert with ``weights`` (from :meth:`expert_weights`) on rows ``x`` (n, C)."""
        w_in, b_in, w_out, b_out = weights
        h = F.linear(x, w_in, b_in)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return F.linear(h, w_out, b_out)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        N, E, k = flat.shape[0], self.num_experts, self.top_k
        logits, experts, weights = self.route(flat)

        # Assignments choice-major (slot = r·N + n), grouped by expert in priority order.
        slot_expert = experts.t().reshape(-1)  # (k·N,)
        order = torch.argsort(slot_expert, stable=True)
        counts = torch.bincount(slot_expert, minlength=E)
        cap = self.capacity(N)
        kept = counts
        if cap is not None:
            starts = counts.cumsum(0) - counts
            rank = torch.arange(k * N, device=x.device) - starts[slot_expert[order]]
            order = order[rank < cap]
            kept = counts.clamp(max=cap)
        sizes = kept.tolist()  # host sync: the segment lengths
        tokens = order % N if k > 1 else order
        xs = flat[tokens]  # (M, C), M ≤ k·N
        params = self.expert_weights()
        outs = [
            self.expert_forward(seg, params[e])
            for e, seg in enumerate(xs.split(sizes))
            if sizes[e] > 0
        ]
        ys = torch.cat(outs) if outs else xs.new_zeros(0, shape[-1])
        ys = ys * weights.t().reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
        out = ys.new_zeros(k * N, shape[-1]).index_copy(0, order, ys)
        out = out.view(k, N, -1).sum(0)
        if self.shared is not None:
            out = out + self.shared(flat)
        self._report(logits, counts, kept, N)
        return out.view(*shape[:-1], out.shape[-1])

    def _report(self, logits: Tensor, counts: Tensor, kept: Tensor, N: int) -> None:
        o = self.options
        E, k = self.num_experts, self.top_k
        logp = logits.log_softmax(dim=-1)
        probs = logp.exp()
        load = counts.float() / max(N * k, 1)  # f_i, Σ = 1
        if o.load_balance_coef > 0:
            self.report_loss("load_balance", o.load_balance_coef * E * (load * probs.mean(0)).sum())
        if o.z_loss_coef > 0:
            z = torch.logsumexp(logits, dim=-1).square().mean()
            self.report_loss("z_loss", o.z_loss_coef * z)
        with torch.no_grad():
            self.report_metric("expert_load_max", load.max())
            self.report_metric("expert_load_min", load.min())
            cv = load.std(correction=0) / load.mean() if E > 1 else load.new_zeros(())
            self.report_metric("expert_load_cv", cv)
            dropped = (counts - kept).sum().float() / max(N * k, 1)
            self.report_metric("dropped_fraction", dropped)
            self.report_metric("router_entropy", -(probs * logp).sum(-1).mean())
            if o.load_metrics == "per_expert":
                for i in range(E):
                    self.report_metric(f"expert_load.{i}", load[i])
