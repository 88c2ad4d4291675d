"""Mixture-of-experts feed-forward block: a router sends each token to ``top_k`` of
``num_experts`` expert FFNs and mixes their outputs with the router's weights.

Sources: the sparsely-gated MoE layer and its load-balancing idea (Shazeer et al. 2017,
"Outrageously Large Neural Networks"); top-2 gating with expert capacity, token dropping and
the auxiliary loss ``E·Σ f_i·P_i`` (GShard, Lepikhin et al. 2020); top-1 routing, capacity
factor and router jitter (Switch Transformer, Fedus et al. 2021); the router z-loss
(ST-MoE, Zoph et al. 2022); always-applied shared experts (DeepSeekMoE, Dai et al. 2024);
top-2 of 8 SwiGLU experts with top-k-then-softmax weights and no token dropping (Mixtral,
Jiang et al. 2024); a shared expert scaled by a learned per-token sigmoid gate (Qwen1.5-MoE,
Qwen Team 2024; Qwen2-MoE, Yang et al. 2024); sigmoid routing scores with a per-expert
correction bias that steers the choice but not the weights (auxiliary-loss-free load
balancing), node/group-limited routing and a routed scaling factor (DeepSeek-V3, Liu et al.
2024).

**Routing** (``route``; the router's logits ``l`` are float32):

- ``topk_softmax``: the k largest logits, softmaxed among themselves (Mixtral; sum to 1).
- ``softmax_topk``: ``p = softmax(l)`` over all E experts, the k largest ``p_i``; divided by
  their sum when ``renormalize`` (Qwen2-MoE/Qwen3-MoE ``norm_topk_prob``), else left as they
  are (Switch, GShard-style, DeepSeekMoE; the default).
- ``sigmoid_topk`` (DeepSeek-V3): scores ``s = sigmoid(l)``; the choice ranks
  ``s + b`` with ``b`` the buffer ``router.score_correction_bias`` (E,) (zeros unless
  imported or set; it gets no gradient). With ``n_group`` > 1 the experts are split into
  ``n_group`` contiguous groups, each scored by the sum of its two largest ``s + b`` (its
  largest when a group holds one expert), and only the experts of the ``topk_group``
  best groups compete for the k places. The weights are the uncorrected ``s_i`` of the
  chosen experts, divided by their sum (+1e-20) when ``renormalize`` (the default here).

Every routing finally multiplies the weights by ``routed_scaling_factor`` (1 by default).

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
  router scores 1 for any top_k) and P_i the mean router probability of expert i: the
  softmax of the logits, or with ``sigmoid_topk`` the normalized scores s_i / Σ_j s_j
  (without the correction bias; DeepSeek-V3's sequence-wise balance loss uses the same
  normalization, here averaged over all tokens of the call); ``z_loss`` = z_loss_coef ·
  mean over tokens of logsumexp(logits)² (the raw logits, whatever the routing). A loss
  whose coefficient is 0 is not reported.
- metrics (detached tensors, no host sync): ``expert_load_max``, ``expert_load_min`` (the
  largest and smallest f_i; 1/E when balanced), ``expert_load_cv`` (std/mean of f_i; 0 when
  balanced), ``dropped_fraction`` (assignments dropped by capacity), ``router_entropy``
  (mean entropy of the router distribution P above, nats; ln E when uniform). With
  ``load_metrics = "per_expert"`` also ``expert_load.<i>`` for every expert.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator
from torch import Tensor, nn

from llmkit.components.ffn.geglu import GeGLU, GeGLUOptions
from llmkit.components.ffn.mlp import ACTIVATIONS, MLP, MLPOptions
from llmkit.components.ffn.swiglu import SwiGLU, SwiGLUOptions
from llmkit.contracts import BuildContext, ComponentOptions, SideOutputs

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

    training_only: ClassVar[frozenset[str]] = frozenset({"load_balance_coef", "z_loss_coef"})

    num_experts: int = Field(8, ge=1, description="Routed experts E.")
    top_k: int = Field(2, ge=1, description="Experts each token is sent to (k ≤ E).")
    routing: Literal["topk_softmax", "softmax_topk", "sigmoid_topk"] = Field(
        "topk_softmax",
        description="topk_softmax: softmax over the k largest logits, weights sum to 1 "
        "(Mixtral); softmax_topk: the k largest probabilities of a softmax over all experts, "
        "renormalized only with renormalize (Switch, GShard-style, DeepSeekMoE; Qwen-MoE); "
        "sigmoid_topk: sigmoid scores, the k largest of score + router.score_correction_bias "
        "(optionally group-limited) weighted by their uncorrected scores (DeepSeek-V3). "
        "With top_k = 1 use softmax_topk or sigmoid_topk without renormalize, or the router "
        "gets no gradient from the LM loss.",
    )
    renormalize: bool | None = Field(
        None,
        description="Divide the k chosen weights by their sum (HF norm_topk_prob). Unset: "
        "false for softmax_topk, true for sigmoid_topk; topk_softmax sums to 1 by "
        "construction and takes no value.",
    )
    routed_scaling_factor: float = Field(
        1.0,
        gt=0.0,
        description="Multiply the routing weights by this, after any renormalization "
        "(DeepSeek-V2/V3 routed_scaling_factor, e.g. 2.5).",
    )
    n_group: int = Field(
        1,
        ge=1,
        description="sigmoid_topk: split the experts into this many contiguous groups (must "
        "divide num_experts) for group-limited routing (DeepSeek-V3 n_group); 1 = no groups.",
    )
    topk_group: int | None = Field(
        None,
        ge=1,
        description="sigmoid_topk: only the experts of this many best groups (group score: "
        "sum of its top-2 corrected scores) may be chosen (DeepSeek-V3 topk_group); "
        "unset = n_group, no limit.",
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
    shared_expert_gate: bool = Field(
        False,
        description="Scale the shared block's output per token by sigmoid(shared_gate(x)), "
        "shared_gate a bias-free d→1 projection (Qwen1.5-MoE/Qwen2-MoE shared_expert_gate); "
        "needs shared_experts ≥ 1.",
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
        if self.shared_expert_gate and self.shared_experts == 0:
            raise ValueError("shared_expert_gate is set but shared_experts is 0")
        return self

    @model_validator(mode="after")
    def _routing_options(self) -> MoEOptions:
        if self.routing == "topk_softmax" and self.renormalize is not None:
            raise ValueError(
                "renormalize has no effect with routing = 'topk_softmax' (its weights sum to 1 "
                "by construction); use softmax_topk with renormalize"
            )
        if self.routing != "sigmoid_topk":
            if self.n_group != 1 or self.topk_group is not None:
                raise ValueError(
                    "n_group and topk_group (group-limited routing) need routing = 'sigmoid_topk'"
                )
            return self
        if self.num_experts % self.n_group:
            raise ValueError(
                f"n_group ({self.n_group}) must divide num_experts ({self.num_experts})"
            )
        groups = self.n_group if self.topk_group is None else self.topk_group
        if groups > self.n_group:
            raise ValueError(
                f"topk_group ({self.topk_group}) must not exceed n_group ({self.n_group})"
            )
        allowed = groups * (self.num_experts // self.n_group)
        if self.top_k > allowed:
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the {allowed} experts of the topk_group "
                f"({groups}) groups a token may use"
            )
        return self

    def shared_width(self, d_model: int) -> int:
        """The hidden size of the shared block (0 without shared experts)."""
        if not self.shared_experts:
            return 0
        return self.shared_hidden or self.shared_experts * self.expert.hidden_size(d_model)

    def parameter_count(self, d_model: int, bias: bool) -> int:
        """The router, ``num_experts`` experts, the shared block and its gate."""
        e, E = self.expert, self.num_experts
        total = E * e.parameter_count(d_model, bias) + d_model * E
        total += E if self.router_bias else 0
        if self.shared_experts:
            shared = e.model_copy(update={"hidden": self.shared_width(d_model)})
            total += shared.parameter_count(d_model, bias)
            total += d_model if self.shared_expert_gate else 0
        return total

    def effective(self, d_model: int, bias: bool) -> dict[str, Any]:
        """Every option, with the expert's as they take effect, the shared block's width
        spelled out and ``renormalize`` resolved (:attr:`renormalized`)."""
        out = self.model_dump(mode="json")
        out["expert"] = self.expert.effective(d_model, bias)
        if self.shared_hidden is None:
            out["shared_hidden"] = self.shared_width(d_model)
        out["renormalize"] = self.renormalized
        return out

    @property
    def renormalized(self) -> bool:
        """Whether the chosen weights are divided by their sum (``renormalize`` resolved)."""
        if self.routing == "topk_softmax":
            return True
        if self.renormalize is None:
            return self.routing == "sigmoid_topk"
        return self.renormalize


# -- module -----------------------------------------------------------------------------------


class Router(nn.Module):
    """The gate: float32 logits ``x Wᵀ + b`` (E outputs), whatever the model's dtype or
    autocast. Deliberately not an ``nn.Linear``, so whole-model passes over linear layers
    (int8 quantization, say) leave routing decisions alone; ``weight``/``bias`` keep the
    names and layout of one. With ``correction_bias`` it also holds the persistent buffer
    ``score_correction_bias`` (E,), zeros, which ``sigmoid_topk`` adds to the scores when
    choosing experts (DeepSeek-V3's ``e_score_correction_bias``; a buffer, so the optimizer
    never touches it). The shared expert's gate is one of these with a single output."""

    score_correction_bias: Tensor | None

    def __init__(self, d: int, num_experts: int, bias: bool, correction_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        if correction_bias:
            self.register_buffer("score_correction_bias", torch.zeros(num_experts))
        else:
            self.score_correction_bias = None

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.float()
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float(), bias)

    def extra_repr(self) -> str:
        extra = ", score_correction_bias" if self.score_correction_bias is not None else ""
        return f"{self.weight.shape[1]} -> {self.weight.shape[0]}, float32{extra}"


class MoE(SideOutputs, nn.Module):
    """Top-k routed mixture of experts with optional shared experts (see the module doc).

    Parameters, one tensor per kind for all experts (``nn.Linear`` layout per expert):
    ``router.weight`` (E, C) of a :class:`Router`; ``w_in`` (E, H_in, C) with H_in = h for
    mlp experts and 2h for gated ones (rows [0, h) gate, [h, 2h) up); ``w_out`` (E, C, h);
    with biases, ``b_in`` (E·H_in,) and ``b_out`` (E·C,), flattened so that optimizers treat
    them as biases (1-D: no weight decay, never a Muon matrix). ``shared`` is an ordinary
    ffn block; with ``shared_expert_gate``, ``shared_gate.weight`` (1, C) (a one-output
    :class:`Router`: float32, bias-free). With ``sigmoid_topk`` the buffer
    ``router.score_correction_bias`` (E,) float32, zeros.
    """

    Options = MoEOptions

    def __init__(self, options: MoEOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        self.n_layers = ctx.n_layers
        e = options.expert
        d = ctx.features
        self.num_experts, self.top_k = options.num_experts, options.top_k
        self.hidden = e.hidden_size(d)
        self.gated = e.name != "mlp"
        if e.name == "mlp":
            self.act: Callable[[Tensor], Tensor] = ACTIVATIONS[e.activation]
        elif e.name == "swiglu":
            self.act = F.silu
        else:
            self.act = functools.partial(F.gelu, approximate=e.approximate)
        bias = e.has_bias(ctx.bias)
        E, h_in = options.num_experts, self.hidden * (2 if self.gated else 1)
        self.router = Router(
            d, E, options.router_bias, correction_bias=options.routing == "sigmoid_topk"
        )
        self.w_in = nn.Parameter(torch.empty(E, h_in, d))
        self.w_out = nn.Parameter(torch.empty(E, d, self.hidden))
        self.b_in = nn.Parameter(torch.zeros(E * h_in)) if bias else None
        self.b_out = nn.Parameter(torch.zeros(E * d)) if bias else None
        self.shared: nn.Module | None = None
        self.shared_gate: Router | None = None
        if options.shared_experts:
            width = options.shared_width(d)
            self.shared = EXPERT_BLOCKS[e.name](e.model_copy(update={"hidden": width}), ctx)
            if options.shared_expert_gate:
                self.shared_gate = Router(d, 1, bias=False)
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
        """Parameters used per token: the router, top_k routed experts, the shared block
        and its gate."""
        E = self.num_experts
        routed = sum(
            p.numel() for p in (self.w_in, self.w_out, self.b_in, self.b_out) if p is not None
        )
        other = sum(p.numel() for p in self.router.parameters())
        for block in (self.shared, self.shared_gate):
            if block is not None:
                other += sum(p.numel() for p in block.parameters())
        return other + routed // E * self.top_k

    def extra_repr(self) -> str:
        o = self.options
        return (
            f"experts={o.num_experts}, top_k={o.top_k}, expert={o.expert.name}, "
            f"hidden={self.hidden}, routing={o.routing}, shared={o.shared_experts}, "
            f"capacity_factor={o.capacity_factor}"
        ) + self._routing_repr()

    def _routing_repr(self) -> str:
        o = self.options
        parts = []
        if o.routing != "topk_softmax":
            parts.append(f"renormalize={o.renormalized}")
        if o.routed_scaling_factor != 1.0:
            parts.append(f"routed_scaling_factor={o.routed_scaling_factor}")
        if o.n_group > 1:
            parts.append(f"n_group={o.n_group}, topk_group={o.topk_group or o.n_group}")
        if self.shared_gate is not None:
            parts.append("shared_expert_gate=True")
        return "".join(f", {p}" for p in parts)

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
        elif o.routing == "softmax_topk":
            weights, experts = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
            if o.renormalized:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            experts, weights = self._sigmoid_topk(logits)
        if o.routed_scaling_factor != 1.0:
            weights = weights * o.routed_scaling_factor
        return logits, experts, weights

    def _sigmoid_topk(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """DeepSeek-V3's choice: expert ids (N, k) and their (renormalized) sigmoid scores
        (see the module doc; transformers' ``DeepseekV3TopkRouter``)."""
        o = self.options
        scores = logits.sigmoid()
        bias = self.router.score_correction_bias
        assert bias is not None
        choice = scores.detach() + bias.float()
        groups, kept = o.n_group, o.topk_group or o.n_group
        if kept < groups:
            per = self.num_experts // groups
            grouped = choice.view(-1, groups, per)
            group_scores = grouped.topk(min(2, per), dim=-1).values.sum(dim=-1)  # (N, G)
            best = group_scores.topk(kept, dim=-1, sorted=False).indices
            allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).flatten(1)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if o.renormalized:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights

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
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = self.shared_gate(flat).sigmoid().to(shared.dtype) * shared
            out = out + shared
        self._report(logits, counts, kept, N)
        return out.view(*shape[:-1], out.shape[-1])

    def _report(self, logits: Tensor, counts: Tensor, kept: Tensor, N: int) -> None:
        o = self.options
        E, k = self.num_experts, self.top_k
        # P: the softmax of the logits, or the normalized sigmoid scores s_i / Σ_j s_j
        # (log_softmax of logsigmoid, computed stably).
        scores = F.logsigmoid(logits) if o.routing == "sigmoid_topk" else logits
        logp = scores.log_softmax(dim=-1)
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
