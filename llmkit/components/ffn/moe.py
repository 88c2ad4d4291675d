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
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.components.ffn.geglu import GeGLU
from llmkit.components.ffn.mlp import ACTIVATIONS, MLP
from llmkit.components.ffn.options import ExpertOptions as ExpertOptions
from llmkit.components.ffn.options import GeGLUExpert as GeGLUExpert
from llmkit.components.ffn.options import MLPExpert as MLPExpert
from llmkit.components.ffn.options import MoEOptions
from llmkit.components.ffn.options import SwiGLUExpert as SwiGLUExpert
from llmkit.components.ffn.swiglu import SwiGLU
from llmkit.contracts import BuildContext, SideOutputs

#: The block class of each expert kind (used for the shared expert).
EXPERT_BLOCKS: dict[str, type[nn.Module]] = {"mlp": MLP, "swiglu": SwiGLU, "geglu": GeGLU}


# -- module -----------------------------------------------------------------------------------


def _call_local(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)``, its parameters replaced by the rank's local tensors when they are
    split for expert parallelism (:func:`llmkit.parallel.experts.local_part`)."""
    if not any(hasattr(p, "device_mesh") for p in module.parameters()):
        return module(x)
    from torch.func import functional_call

    from llmkit.parallel.experts import local_part

    local = {name: local_part(p)[0] for name, p in module.named_parameters()}
    return functional_call(module, local, (x,))


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

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism as expert parallelism: each rank holds ``num_experts / tp``
        experts, the router and the shared expert whole (:mod:`llmkit.parallel.experts`)."""
        from llmkit.parallel.experts import expert_parallel
        from llmkit.parallel.tensor import check_divides

        check_divides("the moe's num_experts", self.num_experts, tp)
        split = [n for n in ("w_in", "w_out", "b_in", "b_out") if getattr(self, n) is not None]
        return {"": expert_parallel(split)}

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
        logits = _call_local(self.router, inp)
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
        if hasattr(bias, "to_local"):  # replicated under expert parallelism
            bias = bias.to_local()
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
        """``(w_in, b_in, w_out, b_out)`` of every expert this rank holds (all of them
        without expert parallelism), as views. ``unbind`` makes the backward one stack of
        per-expert gradients; indexing ``w_in[e]`` would instead add a full-size zero
        gradient per expert (E² work)."""
        from llmkit.parallel.experts import local_part

        w_in, w_out = local_part(self.w_in)[0], local_part(self.w_out)[0]
        E = w_in.shape[0]
        none: list[Tensor | None] = [None] * E
        b_in = none if self.b_in is None else list(local_part(self.b_in)[0].view(E, -1).unbind(0))
        b_out = (
            none if self.b_out is None else list(local_part(self.b_out)[0].view(E, -1).unbind(0))
        )
        return list(zip(w_in.unbind(0), b_in, w_out.unbind(0), b_out, strict=True))

    def _expert_ranks(self) -> tuple[int, int]:
        """This rank's index and the number of ranks the experts are split over (0, 1
        without expert parallelism)."""
        mesh = getattr(self.w_in, "device_mesh", None)
        return (0, 1) if mesh is None else (mesh.get_local_rank(), mesh.size())

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
        # Under expert parallelism this rank runs its experts only; the others' rows stay 0
        # here and come from their ranks when the outputs are summed.
        rank, ranks = self._expert_ranks()
        first = rank * len(params)
        outs = [
            self.expert_forward(seg, params[e - first])
            if first <= e < first + len(params)
            else seg.new_zeros(seg.shape[0], shape[-1])
            for e, seg in enumerate(xs.split(sizes))
            if sizes[e] > 0
        ]
        ys = torch.cat(outs) if outs else xs.new_zeros(0, shape[-1])
        ys = ys * weights.t().reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
        out = ys.new_zeros(k * N, shape[-1]).index_copy(0, order, ys)
        out = out.view(k, N, -1).sum(0)
        if self.shared is not None:
            shared = _call_local(self.shared, flat)
            if self.shared_gate is not None:
                shared = _call_local(self.shared_gate, flat).sigmoid().to(shared.dtype) * shared
            out = out + (shared / ranks if ranks > 1 else shared)  # every rank a share
        if ranks > 1:  # computed whole on every rank: each carries 1/ranks of its gradient
            from llmkit.parallel.experts import scaled_gradient

            logits = scaled_gradient(logits, 1.0 / ranks)
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
