"""Whole tiny models built from named parts through the spec loader, checked end to end."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from llmkit.testing.common import _close, _maxdiff, _seeded, _tolerance

ComponentRef = str | Mapping[str, Any]


def _ref(value: ComponentRef) -> dict[str, Any]:
    return {"name": value} if isinstance(value, str) else dict(value)


def tiny_model_spec(
    attention: ComponentRef,
    position: ComponentRef,
    ffn: ComponentRef,
    norm: ComponentRef,
    **model: Any,
) -> dict[str, Any]:
    """A spec dict for a tiny model (vocab 64, d_model 32, 2 layers, 4 heads, 2 kv heads,
    16 positions) with the given parts; ``model`` overrides or adds ``[model]`` fields."""
    fields: dict[str, Any] = {
        "vocab_size": 64,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "max_seq_len": 16,
        "attention": _ref(attention),
        "position": _ref(position),
        "ffn": _ref(ffn),
        "norm": _ref(norm),
    }
    fields.update(model)
    return {"model": fields}


def check_model_combination(
    attention: ComponentRef,
    position: ComponentRef,
    ffn: ComponentRef,
    norm: ComponentRef,
    *,
    model: Mapping[str, Any] | None = None,
    registry: Any = None,
    device: str | torch.device | None = None,
    seed: int = 0,
) -> Any:
    """Build a tiny model from the named parts (each a name or ``{"name": ..., **options}``)
    through :func:`llmkit.spec.load_spec_dict` and check it end to end: forward with targets
    gives finite logits and loss, backward reaches every parameter, logits are causal and
    deterministic, and, when the attention has the ``kv_cache`` capability, decoding through
    the KV cache (a prompt, a chunk, then token by token) equals the full forward.

    ``model`` overrides ``[model]`` fields (see :func:`tiny_model_spec`); ``n_kv_heads``
    defaults to 2, or 4 (= n_heads) when the attention has ``gqa = false``. A spec that is
    refused raises :class:`llmkit.errors.SpecError` (not caught). Returns the model.
    """
    from llmkit.errors import RegistryError
    from llmkit.model import build_model
    from llmkit.spec import load_spec_dict

    if registry is None:
        from llmkit.registry import get_registry

        registry = get_registry()
    att_name = _ref(attention).get("name")
    try:
        att_record = registry.get("attention", att_name)
    except RegistryError:
        att_record = None  # load_spec_dict reports it
    fields = dict(model or {})
    if att_record is not None and att_record.capabilities.get("gqa") is False:
        fields.setdefault("n_kv_heads", fields.get("n_heads", 4))
    spec = tiny_model_spec(attention, position, ffn, norm, **fields)
    rs = load_spec_dict(spec, registry=registry)
    attention_caps = [plan.attention.record.capabilities for plan in rs.layers]
    kv_cache = bool(attention_caps) and all(c.get("kv_cache") for c in attention_caps)
    requires = {r for c in attention_caps for r in c.get("requires", [])}
    dev = torch.device(device) if device else torch.device("cuda" if "cuda" in requires else "cpu")
    label = f"model with {_describe(spec['model'])}"

    def expect(cond: bool, message: str) -> None:
        if not cond:
            raise AssertionError(f"{label}: {message}")

    def run(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except AssertionError:
            raise
        except Exception as exc:
            raise AssertionError(f"{label}: {what} raised {type(exc).__name__}: {exc}") from exc

    with _seeded(seed, dev):
        net = run("build_model", build_model, rs)
        net = run(f".to({str(dev)!r})", net.to, dev)
    m = rs.model
    B, T, V = 2, m.max_seq_len, m.vocab_size
    gen = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, V, (B, T), generator=gen).to(dev)
    targets = torch.randint(0, V, (B, T), generator=gen).to(dev)

    net.train()
    out = run("forward with targets", net, idx, targets)
    expect(out.logits.shape == (B, T, V), f"logits have shape {tuple(out.logits.shape)}")
    expect(bool(torch.isfinite(out.logits).all()), "logits are not finite")
    expect(out.loss is not None and bool(torch.isfinite(out.loss)), f"loss is {out.loss}")
    for key, value in out.aux_losses.items():
        expect(bool(torch.isfinite(value).all()), f"auxiliary loss {key} is not finite")
    run("backward", out.total_loss.backward)
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        expect(p.grad is not None, f"no gradient reaches {name}")
        expect(bool(torch.isfinite(p.grad).all()), f"the gradient of {name} is not finite")
        expect(bool(p.grad.abs().sum() > 0), f"the gradient of {name} is exactly zero")

    net.eval()
    with torch.no_grad():
        full = run("eval forward", net, idx).logits
        expect(torch.equal(full, net(idx).logits), "two eval forwards differ (not deterministic)")
        with _seeded(seed, dev):
            twin = build_model(rs).to(dev).eval()
        expect(
            torch.equal(full, twin(idx).logits),
            "a second model built under the same seed gives different logits",
        )
        cut = T // 2
        changed = idx.clone()
        changed[:, cut:] = (changed[:, cut:] + 1) % V
        other = net(changed).logits
        expect(
            _close(other[:, :cut], full[:, :cut], 1e-5, 1e-5),
            f"not causal: changing tokens from position {cut} on changed earlier logits "
            f"(max diff {_maxdiff(other[:, :cut], full[:, :cut]):.2e})",
        )
        expect(_maxdiff(other[:, cut:], full[:, cut:]) > 0, "changing tokens changed no logits")
        if kv_cache:
            cache = run("new_cache", net.new_cache)
            pieces = [(0, 5), (5, 8)] + [(t, t + 1) for t in range(8, T)]
            got = []
            for a, b in pieces:
                step = run(
                    f"decoding tokens {a}..{b - 1} with the cache", net, idx[:, a:b], cache=cache
                )
                got.append(step.logits)
            inc = torch.cat(got, dim=1)
            atol = _tolerance(dev)
            expect(
                _close(inc, full, atol, atol),
                f"KV-cache decoding (prompt of 5, a chunk of 3, then one token at a time) "
                f"differs from the full forward by {_maxdiff(inc, full):.2e}",
            )
            expect(cache.position == T, f"the cache position is {cache.position}, not {T}")
    return net


def _describe(model: Mapping[str, Any]) -> str:
    parts = []
    for slot in ("attention", "position", "ffn", "norm"):
        ref = model[slot]
        opts = {k: v for k, v in ref.items() if k != "name"}
        parts.append(f"{slot}={ref['name']}{opts if opts else ''}")
    extra = {
        k: v
        for k, v in model.items()
        if k not in ("attention", "position", "ffn", "norm")
        and k not in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len")
    }
    return ", ".join(parts) + (f" ({extra})" if extra else "")
