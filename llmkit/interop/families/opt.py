"""The OPT family (``OPTForCausalLM``): learned absolute positions with OPT's offset of 2,
LayerNorm (pre-LN, or post-LN as OPT-350m), multi-head attention and a two-layer ReLU MLP,
biases switched together by ``enable_bias``, and a head tied to the embedding (or not).

transformers names: ``model.decoder.embed_tokens``, ``model.decoder.embed_positions``,
``model.decoder.layers.{i}.self_attn.{q,k,v,out}_proj``, ``.self_attn_layer_norm``,
``.fc1``, ``.fc2``, ``.final_layer_norm`` (the layer's second norm),
``model.decoder.final_layer_norm``, ``lm_head``.

Positions. ``OPTLearnedPositionalEmbedding`` has ``max_position_embeddings + 2`` rows and
reads row ``p + 2`` for a token at position p, where p counts the real tokens before it
(``cumsum(mask) - 1``): the positions llmkit gives a left-padded row. Row 1 is read only for
padding (p = −1) and row 0 never, so neither changes any real token's output. llmkit's
``wpe`` holds rows 2…; import drops the first two and export writes zeros there, so an
imported checkpoint exports bit for bit except those two rows (an original OPT checkpoint
holds trained values there, which llmkit has no place for).

Config mapping: ``do_layer_norm_before`` true is a pre_norm block with a final LayerNorm
(none when ``_remove_final_layer_norm``), false a post_norm block and no final norm (as
transformers builds OPT-350m). ``ffn_dim`` is the MLP's hidden size, left unset when it is
llmkit's default 4·d_model (so a spec that leaves it unset exports and reads back the same).
``enable_bias`` is the linear layers' biases (the LayerNorms keep theirs).
``layer_norm_elementwise_affine`` false is a LayerNorm without bias whose gain is fixed at
1: export writes it for a bias-free LayerNorm and refuses the model if any gain is not
exactly 1. OPT's LayerNorm eps is fixed at 1e-5. Refused: ``word_embed_proj_dim`` other
than ``hidden_size`` (OPT-350m's ``project_in``/``project_out`` between a narrower embedding
and the blocks; llmkit's embedding is d_model wide). ``layerdrop`` and the dropout rates
are training settings.

Export: a model GPT-2 can also hold (pre-norm, biases everywhere, eps 1e-5) is written as
GPT-2 unless its MLP is ReLU, OPT's activation.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from llmkit.errors import LlmkitError
from llmkit.interop.family import (
    Family,
    Refused,
    activation,
    hf_activation,
    need,
    same_in_every_layer,
)
from llmkit.interop.family_common import (
    attention_biases,
    layernorm,
    learned_positions,
    mlp,
    plain_mha,
)
from llmkit.interop.mapping import Rule, mapped, same, separate_qkv
from llmkit.spec import ResolvedSpec

#: Rows of OPT's position table before position 0.
OFFSET = 2
#: OPT's LayerNorm epsilon (nn.LayerNorm's default; the config has no setting).
EPS = 1e-5


class OPT(Family):
    priority = 20
    architectures: ClassVar[dict[str, str]] = {"opt": "OPTForCausalLM"}
    ignore = ()

    # -- import -----------------------------------------------------------------------------
    def spec(self, cfg: dict[str, Any]) -> dict[str, Any]:
        d, heads = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
        proj = cfg.get("word_embed_proj_dim")
        if proj is not None and proj != d:
            raise Refused(
                f"config word_embed_proj_dim={proj} differs from hidden_size={d} "
                "(project_in/project_out have no llmkit equivalent)"
            )
        if d % heads:
            raise Refused(f"hidden_size {d} is not a multiple of num_attention_heads {heads}")
        pre = bool(cfg.get("do_layer_norm_before", True))
        bias = bool(cfg.get("enable_bias", True))
        affine = bool(cfg.get("layer_norm_elementwise_affine", True))
        norm: dict[str, Any] = {"name": "layernorm", "eps": EPS}
        if affine != bias:
            norm["bias"] = affine
        model: dict[str, Any] = {
            "vocab_size": need(cfg, "vocab_size"),
            "d_model": d,
            "n_layers": need(cfg, "num_hidden_layers"),
            "n_heads": heads,
            "max_seq_len": need(cfg, "max_position_embeddings"),
            "bias": bias,
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "final_norm": pre and not cfg.get("_remove_final_layer_norm", False),
            "init_std": cfg.get("init_std", 0.02),
            "block": {"name": "pre_norm" if pre else "post_norm"},
            "norm": norm,
            "position": {"name": "learned"},
            "attention": {"name": "sdpa"},
            "ffn": {
                "name": "mlp",
                "activation": activation(cfg.get("activation_function", "relu")),
            },
        }
        if need(cfg, "ffn_dim") != 4 * d:  # 4·d: llmkit's default, left unset
            model["ffn"]["hidden"] = cfg["ffn_dim"]
        return model

    def rules(self, cfg: dict[str, Any]) -> list[Rule]:
        m = self.spec(cfg)
        d, bias = m["d_model"], m["bias"]
        affine = m["norm"].get("bias", bias)
        dec = "model.decoder."
        out = [
            same("tok_emb.weight", dec + "embed_tokens.weight"),
            mapped(
                "position.wpe.weight",
                dec + "embed_positions.weight",
                lambda t: t[OFFSET:],
                lambda t: torch.cat([t.new_zeros(OFFSET, t.shape[1]), t]),
            ),
        ]
        for i in range(m["n_layers"]):
            hf, us = f"{dec}layers.{i}.", f"layers.{i}."
            a = hf + "self_attn."
            out += [
                same(us + "attn.out_proj.weight", a + "out_proj.weight"),
                same(us + "ffn.in_proj.weight", hf + "fc1.weight"),
                same(us + "ffn.out_proj.weight", hf + "fc2.weight"),
            ]
            out += separate_qkv(us + "attn.qkv", a, [d] * 3, bias=bias)
            if bias:
                out += [
                    same(us + "attn.out_proj.bias", a + "out_proj.bias"),
                    same(us + "ffn.in_proj.bias", hf + "fc1.bias"),
                    same(us + "ffn.out_proj.bias", hf + "fc2.bias"),
                ]
            out += _norm_rules(us + "norm1", hf + "self_attn_layer_norm", d, affine)
            out += _norm_rules(us + "norm2", hf + "final_layer_norm", d, affine)
        if m["final_norm"]:
            out += _norm_rules("norm_f", dec + "final_layer_norm", d, affine)
        if not m["tie_embeddings"]:
            out.append(same("lm_head.weight", "lm_head.weight"))
        return out

    # -- export -----------------------------------------------------------------------------
    def notes(self, cfg: dict[str, Any]) -> list[str]:
        return [
            "embed_positions' first two rows (OPT's offset; never read for a real token) are "
            "not kept: export writes zeros there"
        ]

    def hf_config(self, rs: ResolvedSpec) -> dict[str, Any]:
        m = rs.model
        plain_mha(rs)
        learned_positions(rs)
        block = same_in_every_layer(rs, "block")[0]
        if block not in ("pre_norm", "post_norm"):
            raise Refused(f"block {block!r} (OPT normalizes before or after each sublayer)")
        if block == "post_norm" and m.final_norm:
            raise Refused("a final norm after post_norm blocks (post-LN OPT has none)")
        eps, norm_bias = layernorm(rs)
        if eps != EPS:
            raise Refused(f"LayerNorm eps {eps} (OPT's is fixed at {EPS})")
        act, hidden, mlp_bias = mlp(rs)
        qkv_bias, out_bias = attention_biases(rs)
        if len({qkv_bias, out_bias, mlp_bias}) > 1:
            raise Refused("some linear layers have biases and some not (OPT: enable_bias)")
        if m.attn_scale is not None:
            raise Refused(f"attn_scale {m.attn_scale} (OPT scales scores by 1/sqrt(head_dim))")
        cfg: dict[str, Any] = {
            "model_type": "opt",
            "vocab_size": m.vocab_size,
            "hidden_size": m.d_model,
            "word_embed_proj_dim": m.d_model,
            "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads,
            "max_position_embeddings": m.max_seq_len,
            "ffn_dim": hidden or 4 * m.d_model,
            "activation_function": hf_activation(act),
            "do_layer_norm_before": block == "pre_norm",
            "_remove_final_layer_norm": block == "pre_norm" and not m.final_norm,
            "enable_bias": qkv_bias,
            "layer_norm_elementwise_affine": norm_bias,
            "init_std": m.init_std,
            "tie_word_embeddings": m.tie_embeddings,
        }
        return cfg


def _norm_rules(ours: str, theirs: str, d: int, affine: bool) -> list[Rule]:
    """A LayerNorm's gain and bias; without ``elementwise_affine`` the checkpoint holds
    neither, llmkit's gain is 1 and export refuses any other gain."""
    if affine:
        return [same(f"{ours}.weight", f"{theirs}.weight"), same(f"{ours}.bias", f"{theirs}.bias")]

    def no_gain(t: torch.Tensor) -> list[torch.Tensor]:
        if not torch.all(t == 1):
            raise LlmkitError(
                f"{ours}.weight is not all ones: OPT's LayerNorm without elementwise_affine "
                "has no gain to hold it"
            )
        return []

    return [Rule(f"{ours}.weight", (), lambda _: torch.ones(d), no_gain)]


FAMILY = OPT()
