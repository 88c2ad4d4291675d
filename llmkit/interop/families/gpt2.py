"""The GPT-2 family (``GPT2LMHeadModel``): learned absolute positions, pre-LN blocks of
LayerNorm with bias, multi-head attention with biases, a two-layer MLP with biases, a final
LayerNorm and a head tied to the embedding (or not, ``tie_word_embeddings``).

transformers names: ``transformer.wte``, ``transformer.wpe``, ``transformer.h.{i}.ln_1``,
``.attn.c_attn`` (q, k and v side by side), ``.attn.c_proj``, ``.ln_2``, ``.mlp.c_fc``,
``.mlp.c_proj``, ``transformer.ln_f``, ``lm_head``. Every linear layer is a ``Conv1D``
whose weight is stored (in, out): transposed against ``nn.Linear``. Older checkpoints also
hold the causal-mask buffers ``.attn.bias`` and ``.attn.masked_bias``: skipped.

Config mapping: ``n_inner`` (default 4·n_embd) is the MLP's hidden size,
``activation_function`` its activation; ``scale_attn_weights=false`` (scores not divided
by √head_dim) is ``attn_scale = 1.0``. ``reorder_and_upcast_attn`` is accepted: it only
changes how transformers' eager path computes the same scores in mixed precision (k
pre-scaled, fp32 softmax), not what the model computes; export writes ``false``.
Refused: ``scale_attn_by_inverse_layer_idx`` (a softmax scale per layer, 1/(i+1), which
llmkit's single ``attn_scale`` cannot hold) and ``add_cross_attention`` (an encoder-decoder
cross-attention llmkit has no module for).

Dropout rates (``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop``) are training settings and
are not carried over (as for every family). The helpers at the bottom (what a spec must be
to hold "plain" attention, a LayerNorm, an MLP) are shared with the OPT and MPT families.
"""

from __future__ import annotations

from typing import Any, ClassVar

from llmkit.interop import attention_layers as layers_of
from llmkit.interop.family import (
    Family,
    Refused,
    activation,
    hf_activation,
    need,
    refuse_set,
    same_in_every_layer,
)
from llmkit.interop.mapping import Rule, same, transposed
from llmkit.spec import ResolvedSpec


def first(cfg: dict[str, Any], *keys: str) -> Any:
    """The first of ``keys`` the config sets (canonical name first, then its alias)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise Refused(f"config.json has no {keys[0]!r}")


class GPT2(Family):
    priority = 5
    prefix = "transformer."
    architectures: ClassVar[dict[str, str]] = {"gpt2": "GPT2LMHeadModel"}
    ignore = ("*.attn.bias", "*.attn.masked_bias")

    # -- import -----------------------------------------------------------------------------
    def spec(self, cfg: dict[str, Any]) -> dict[str, Any]:
        refuse_set(
            cfg,
            scale_attn_by_inverse_layer_idx=lambda v: not v,
            add_cross_attention=lambda v: not v,
        )
        d = first(cfg, "n_embd", "hidden_size")
        heads = first(cfg, "n_head", "num_attention_heads")
        if d % heads:
            raise Refused(f"n_embd {d} is not a multiple of n_head {heads}")
        model: dict[str, Any] = {
            "vocab_size": need(cfg, "vocab_size"),
            "d_model": d,
            "n_layers": first(cfg, "n_layer", "num_hidden_layers"),
            "n_heads": heads,
            "max_seq_len": first(cfg, "n_positions", "max_position_embeddings"),
            "bias": True,
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "final_norm": True,
            "init_std": cfg.get("initializer_range", 0.02),
            "block": {"name": "pre_norm"},
            "norm": {"name": "layernorm", "eps": cfg.get("layer_norm_epsilon", 1e-5)},
            "position": {"name": "learned"},
            "attention": {"name": "sdpa"},
            "ffn": {
                "name": "mlp",
                "activation": activation(cfg.get("activation_function", "gelu_new")),
            },
        }
        if cfg.get("n_inner"):  # unset: 4·n_embd, llmkit's default multiplier
            model["ffn"]["hidden"] = cfg["n_inner"]
        if not cfg.get("scale_attn_weights", True):
            model["attn_scale"] = 1.0
        return model

    def rules(self, cfg: dict[str, Any]) -> list[Rule]:
        m = self.spec(cfg)
        out = [
            same("tok_emb.weight", "transformer.wte.weight"),
            same("position.wpe.weight", "transformer.wpe.weight"),
        ]
        for i in range(m["n_layers"]):
            hf, us = f"transformer.h.{i}.", f"layers.{i}."
            out += [
                same(us + "norm1.weight", hf + "ln_1.weight"),
                same(us + "norm1.bias", hf + "ln_1.bias"),
                transposed(us + "attn.qkv.weight", hf + "attn.c_attn.weight"),
                same(us + "attn.qkv.bias", hf + "attn.c_attn.bias"),
                transposed(us + "attn.out_proj.weight", hf + "attn.c_proj.weight"),
                same(us + "attn.out_proj.bias", hf + "attn.c_proj.bias"),
                same(us + "norm2.weight", hf + "ln_2.weight"),
                same(us + "norm2.bias", hf + "ln_2.bias"),
                transposed(us + "ffn.in_proj.weight", hf + "mlp.c_fc.weight"),
                same(us + "ffn.in_proj.bias", hf + "mlp.c_fc.bias"),
                transposed(us + "ffn.out_proj.weight", hf + "mlp.c_proj.weight"),
                same(us + "ffn.out_proj.bias", hf + "mlp.c_proj.bias"),
            ]
        out += [
            same("norm_f.weight", "transformer.ln_f.weight"),
            same("norm_f.bias", "transformer.ln_f.bias"),
        ]
        if not m["tie_embeddings"]:
            out.append(same("lm_head.weight", "lm_head.weight"))
        return out

    # -- export -----------------------------------------------------------------------------
    def hf_config(self, rs: ResolvedSpec) -> dict[str, Any]:
        m = rs.model
        plain_attention(rs)
        learned_positions(rs)
        if same_in_every_layer(rs, "block")[0] != "pre_norm":
            raise Refused("the block is not pre_norm (GPT-2 normalizes before each sublayer)")
        if not m.final_norm:
            raise Refused("final_norm is off (GPT-2 has a final LayerNorm, ln_f)")
        eps, norm_bias = layernorm(rs)
        act, hidden, mlp_bias = mlp(rs)
        biases = {"qkv_bias": attn_bias(rs)[0], "attn_out_bias": attn_bias(rs)[1],
                  "ffn bias": mlp_bias, "norm bias": norm_bias}  # fmt: skip
        missing = [k for k, v in biases.items() if not v]
        if missing:
            raise Refused(f"{missing[0]} is off (GPT-2 has a bias on every linear and norm)")
        if act == "relu":
            raise Refused("a ReLU MLP is OPT's form (exported as OPT)")
        if m.attn_scale not in (None, 1.0):
            raise Refused(
                f"attn_scale {m.attn_scale} (GPT-2 scales scores by 1/sqrt(head_dim), or not "
                "at all with scale_attn_weights=false)"
            )
        return {
            "model_type": "gpt2",
            "vocab_size": m.vocab_size,
            "n_embd": m.d_model,
            "n_layer": m.n_layers,
            "n_head": m.n_heads,
            "n_positions": m.max_seq_len,
            "n_inner": hidden,  # None: 4·n_embd
            "activation_function": "gelu_new" if act == "gelu_tanh" else hf_activation(act),
            "layer_norm_epsilon": eps,
            "initializer_range": m.init_std,
            "scale_attn_weights": m.attn_scale is None,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "add_cross_attention": False,
            "tie_word_embeddings": m.tie_embeddings,
        }


# -- checks of a spec shared with the OPT and MPT families ------------------------------------


def plain_attention(rs: ResolvedSpec) -> None:
    """Multi-head attention over every earlier key, no q/k transform, a plain embedding and
    a plain head: what GPT-2, OPT and MPT have in common."""
    m = rs.model
    if m.kv_heads != m.n_heads:
        raise Refused(f"n_kv_heads {m.kv_heads} (this family has multi-head attention only)")
    if m.dim_head * m.n_heads != m.d_model:
        raise Refused(f"head_dim {m.dim_head} is not d_model / n_heads")
    if same_in_every_layer(rs, "qk_transform")[0]:
        raise Refused("qk_transform (this family has no q/k normalization)")
    sizes = {w for w in layers_of.windows(rs) if w is not None}
    if sizes:
        raise Refused(f"a sliding window of {min(sizes)} (this family attends in full)")
    for j in range(len(rs.layers)):
        if rs.layers[j].attention.options.model_dump().get("softcap") is not None:
            raise Refused(f"attention softcap in layer {j}")
    if m.embedding_scale != 1.0:
        raise Refused(f"embedding_scale {m.embedding_scale!r}")
    if m.logit_softcap is not None:
        raise Refused(f"logit_softcap {m.logit_softcap}")
    if m.head_bias:
        raise Refused("head_bias (this family's head has no bias)")


def learned_positions(rs: ResolvedSpec) -> None:
    """Learned absolute positions for the whole model."""
    name, _ = same_in_every_layer(rs, "position")
    if rs.position.name != "learned" or name != "learned":
        raise Refused(f"position {rs.position.name!r} (this family has learned positions)")


def attn_bias(rs: ResolvedSpec) -> tuple[bool, bool]:
    """(q/k/v bias, output projection bias) of the spec."""
    m = rs.model
    qkv = m.bias if m.qkv_bias is None else m.qkv_bias
    out = m.bias if m.attn_out_bias is None else m.attn_out_bias
    return bool(qkv), bool(out)


def layernorm(rs: ResolvedSpec) -> tuple[float, bool]:
    """(eps, bias) of a LayerNorm used everywhere (each layer and the final norm)."""
    name, opts = same_in_every_layer(rs, "norm")
    final = (rs.norm.name, rs.norm.options.model_dump())
    if rs.model.final_norm and final != (name, opts):
        raise Refused("the final norm differs from the layers' norms")
    if name != "layernorm":
        raise Refused(f"norm {name!r} (this family has LayerNorm)")
    bias = rs.model.bias if opts.get("bias") is None else opts["bias"]
    return opts["eps"], bool(bias)


def mlp(rs: ResolvedSpec) -> tuple[str, int | None, bool]:
    """(activation, hidden size, bias) of a two-layer MLP used in every layer; the hidden
    size is None when the spec leaves it to the default 4·d_model (an HF config then leaves
    it out too, so the spec reads back the same)."""
    from llmkit.contracts import ffn_hidden

    name, opts = same_in_every_layer(rs, "ffn")
    if name != "mlp":
        raise Refused(f"ffn {name!r} (this family has a two-layer MLP)")
    hidden = opts.get("hidden")
    if not hidden and (opts["multiplier"], opts["multiple_of"]) != (4.0, 1):
        hidden = ffn_hidden(rs.model.d_model, None, opts["multiplier"], opts["multiple_of"])
    bias = rs.model.bias if opts.get("bias") is None else opts["bias"]
    return opts["activation"], hidden or None, bool(bias)


FAMILY = GPT2()
