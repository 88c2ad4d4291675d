"""The options of the feed-forward blocks (torch-free: a spec is checked without the blocks):
their sizes (:class:`~llmkit.components.ffn.width.HiddenWidth`), and the mixture of experts'
routing, experts and their checks."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from llmkit.components.ffn.width import HiddenWidth
from llmkit.options import ComponentOptions

#: The activations of the ``mlp`` block.
Activation = Literal["gelu", "gelu_tanh", "relu", "relu2", "silu"]


class MLPOptions(HiddenWidth, ComponentOptions):
    """Options of the two-layer MLP (its size: :class:`HiddenWidth`, two matrices)."""

    activation: Activation = Field(
        "gelu",
        description="Activation: gelu, gelu_tanh (GPT-2's approximation), relu, "
        "relu2 (squared ReLU, Primer) or silu.",
    )
    hidden: int | None = Field(
        None, ge=1, description="Hidden size; when unset, multiplier·d_model rounded up."
    )
    multiplier: float = Field(
        4.0, gt=0.0, description="Hidden size as a multiple of d_model (when hidden is unset)."
    )
    multiple_of: int = Field(
        1, ge=1, description="Round the derived hidden size up to a multiple of this."
    )
    bias: bool | None = Field(
        None, description="Biases on both projections; unset follows the model's bias setting."
    )


class GatedFFNOptions(HiddenWidth, ComponentOptions):
    """Options shared by the gated feed-forward blocks (their size: :class:`HiddenWidth`,
    three matrices)."""

    matrices: ClassVar[int] = 3

    hidden: int | None = Field(
        None, ge=1, description="Hidden size; when unset, multiplier·d_model rounded up."
    )
    multiplier: float = Field(
        8 / 3,
        gt=0.0,
        description="Hidden size as a multiple of d_model (when hidden is unset); the default "
        "2/3·4 keeps the parameter count of a 4·d_model MLP, as in LLaMA.",
    )
    multiple_of: int = Field(
        1, ge=1, description="Round the derived hidden size up to a multiple of this (LLaMA: 256)."
    )
    bias: bool | None = Field(
        None, description="Biases on all projections; unset follows the model's bias setting."
    )


class SwiGLUOptions(GatedFFNOptions):
    """Options of the SwiGLU block."""


class GeGLUOptions(GatedFFNOptions):
    """Options of the GeGLU block."""

    approximate: Literal["none", "tanh"] = Field(
        "none", description="GELU form: exact (erf) or the tanh approximation."
    )


# -- mixture of experts ------------------------------------------------------------------------


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
