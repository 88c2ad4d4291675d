"""The ``position`` kind: schemes against :class:`~llmkit.contracts.PositionalScheme`."""

from __future__ import annotations

import torch
from torch import Tensor

from llmkit.contracts import POSITION_SITES, DistanceBias
from llmkit.testing.common import (
    Options,
    Record,
    _build_module,
    _capabilities,
    _check_grads,
    _check_input_grad,
    _close,
    _device,
    _dtypes,
    _expect,
    _maxdiff,
    _randn,
    _run,
    small_context,
)


def check_position(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """Check a positional scheme against :class:`~llmkit.contracts.PositionalScheme`."""
    dev = _device(record, device)
    caps = _capabilities(record)
    ctx = small_context()
    module = _build_module(record, options, ctx, dev).eval()
    for method in ("embed", "rotate", "score_bias"):
        _expect(
            callable(getattr(module, method, None)),
            record,
            f"has no {method}() method (subclass llmkit.contracts.PositionalScheme)",
        )
    acts = frozenset(getattr(module, "acts_on", frozenset()))
    declared = frozenset(caps.get("acts_on", []))
    _expect(
        acts == declared,
        record,
        f"its class says acts_on={sorted(acts)} but its registry capabilities say "
        f"acts_on={sorted(declared)}; the spec checks compatibility from the capabilities",
    )
    unknown = acts - set(POSITION_SITES)
    _expect(not unknown, record, f"acts on unknown sites {sorted(unknown)}; know {POSITION_SITES}")

    B, T, C = 2, 8, ctx.d_model
    H, Hkv, D = ctx.n_heads, ctx.n_kv_heads, ctx.head_dim
    gen = torch.Generator().manual_seed(7)
    pos = torch.arange(T, device=dev)
    x = _randn(gen, B, T, C, device=dev)
    q = _randn(gen, B, H, T, D, device=dev)
    k = _randn(gen, B, Hkv, T, D, device=dev)

    def embed(inp: Tensor, p: Tensor, what: str) -> Tensor:
        before = inp.detach().clone()
        desc = f"embed ({what}; x {tuple(inp.shape)} {inp.dtype}, positions {tuple(p.shape)})"
        y = _run(record, desc, module.embed, inp, p)
        _expect(
            isinstance(y, Tensor) and y.shape == inp.shape,
            record,
            f"{desc} returned {getattr(y, 'shape', y)!r}, expected shape {tuple(inp.shape)}",
        )
        _expect(y.dtype == inp.dtype, record, f"{desc} returned dtype {y.dtype}")
        _expect(bool(torch.isfinite(y).all()), record, f"{desc} returned non-finite values")
        _expect(torch.equal(inp.detach(), before), record, f"{desc} modified x in place")
        return y

    def rotate(qq: Tensor, kk: Tensor, p: Tensor, what: str) -> tuple[Tensor, Tensor]:
        before = (qq.detach().clone(), kk.detach().clone())
        desc = f"rotate ({what}; q {tuple(qq.shape)} {qq.dtype}, positions {tuple(p.shape)})"
        res = _run(record, desc, module.rotate, qq, kk, p)
        _expect(isinstance(res, tuple) and len(res) == 2, record, f"{desc} must return (q, k)")
        for name, new, old in zip("qk", res, (qq, kk)):
            _expect(
                isinstance(new, Tensor) and new.shape == old.shape and new.dtype == old.dtype,
                record,
                f"{desc} returned {name} {getattr(new, 'shape', new)!r} "
                f"{getattr(new, 'dtype', '')}, expected {tuple(old.shape)} {old.dtype}",
            )
            _expect(bool(torch.isfinite(new).all()), record, f"{desc} returned non-finite {name}")
        _expect(
            torch.equal(qq.detach(), before[0]) and torch.equal(kk.detach(), before[1]),
            record,
            f"{desc} modified q or k in place",
        )
        return res

    def scores(qq: Tensor, kk: Tensor) -> Tensor:
        return qq.float() @ kk.float().repeat_interleave(H // Hkv, 1).transpose(-1, -2)

    with torch.no_grad():
        ex = embed(x, pos, "positions 0..T-1")
        rq, rk = rotate(q, k, pos, "positions 0..T-1")
        bias = _run(record, "score_bias()", module.score_bias)

        # Sites it does not declare are left alone (the spec only checks declared sites).
        if "embedding" not in acts:
            _expect(torch.equal(ex, x), record, "embed changes x but acts_on lacks 'embedding'")
        if "qk" not in acts:
            _expect(
                torch.equal(rq, q) and torch.equal(rk, k),
                record,
                "rotate changes q/k but acts_on lacks 'qk'",
            )
        if "score_bias" not in acts:
            _expect(bias is None, record, "score_bias() is not None but acts_on lacks 'score_bias'")

        if "embedding" in acts:
            same = x[:, :1].expand(B, T, C).contiguous()
            es = embed(same, pos, "one token at every position")
            constant = _maxdiff(es[:, 1:], es[:, :1].expand_as(es[:, 1:])) == 0
            if constant and next(module.parameters(), None) is not None:
                for p in module.parameters():  # e.g. a table initialized to zeros
                    p.add_(torch.randn(p.shape, generator=gen).to(p) * 0.02)
                es = embed(same, pos, "one token at every position, parameters perturbed")
                rq, rk = rotate(q, k, pos, "positions 0..T-1, parameters perturbed")
            _expect(
                _maxdiff(es[:, 1:], es[:, :1].expand_as(es[:, 1:])) > 0,
                record,
                "acts on 'embedding' but embed gives the same output for the same token at "
                "every position",
            )
            ex = embed(x, pos, "positions 0..T-1")
        if "qk" in acts:
            last = ctx.max_seq_len - T
            sq, sk = rotate(q, k, pos + last, f"positions shifted by {last}")
            base = scores(rq, rk)
            shifted = scores(sq, sk)
            _expect(
                _close(shifted, base, 1e-4, 1e-4),
                record,
                f"acts on 'qk' but rotated scores q·kᵀ change by {_maxdiff(shifted, base):.2e} "
                f"when every position shifts by {last}: they must depend only on relative position",
            )
            wq, wk = rotate(q, k, pos * 2, "positions 0, 2, 4, ...")
            _expect(
                _maxdiff(scores(wq, wk), base) > 1e-4,
                record,
                "acts on 'qk' but rotated scores do not change when relative positions double",
            )
        if "score_bias" in acts:
            _expect(
                isinstance(bias, DistanceBias),
                record,
                f"acts on 'score_bias' but score_bias() returned {type(bias).__name__}, "
                "not a DistanceBias",
            )
            slopes = bias.slopes
            _expect(
                isinstance(slopes, Tensor) and tuple(slopes.shape) == (H,),
                record,
                f"DistanceBias slopes must have shape (n_heads,) = ({H},), "
                f"got {getattr(slopes, 'shape', slopes)!r}",
            )
            _expect(bool(torch.isfinite(slopes).all()), record, "DistanceBias slopes not finite")
            dense = _run(record, "DistanceBias.dense(3, 8)", bias.dense, 3, 8)
            _expect(tuple(dense.shape) == (H, 3, 8), record, "DistanceBias.dense shape is wrong")

        # Incremental calls (what a KV cache does) equal the full call, position by position.
        for p in (0, T // 2, T - 1):
            one = torch.tensor([p], device=dev)
            e1 = embed(x[:, p : p + 1], one, f"one token at position {p}")
            _expect(
                _close(e1, ex[:, p : p + 1], 1e-6, 1e-6),
                record,
                f"embed of one token at position {p} differs from row {p} of the full call",
            )
            q1, k1 = rotate(q[:, :, p : p + 1], k[:, :, p : p + 1], one, f"position {p} alone")
            _expect(
                _close(q1, rq[:, :, p : p + 1], 1e-6, 1e-6)
                and _close(k1, rk[:, :, p : p + 1], 1e-6, 1e-6),
                record,
                f"rotate of one token at position {p} differs from row {p} of the full call",
            )

        # (B, T) positions: row b gets its own positions (left padding shifts them).
        pos_bt = torch.stack([pos, pos + 3])
        e_bt = embed(x, pos_bt, "(B, T) positions")
        e_shift = embed(x[1:], pos + 3, "positions 3..T+2")
        _expect(
            _close(e_bt[:1], ex[:1], 1e-6, 1e-6) and _close(e_bt[1:], e_shift, 1e-6, 1e-6),
            record,
            "embed with (B, T) positions differs from calling each row with its (T,) positions",
        )
        q_bt, k_bt = rotate(q, k, pos_bt, "(B, T) positions")
        q_sh, k_sh = rotate(q[1:], k[1:], pos + 3, "positions 3..T+2")
        _expect(
            _close(q_bt[:1], rq[:1], 1e-6, 1e-6)
            and _close(k_bt[:1], rk[:1], 1e-6, 1e-6)
            and _close(q_bt[1:], q_sh, 1e-6, 1e-6)
            and _close(k_bt[1:], k_sh, 1e-6, 1e-6),
            record,
            "rotate with (B, T) positions differs from calling each row with its (T,) positions",
        )
        for dtype in _dtypes(record):
            if dtype == torch.float32:
                continue
            lq, lk = rotate(q.to(dtype), k.to(dtype), pos, f"{dtype} q/k")
            _expect(
                max(_maxdiff(lq, rq), _maxdiff(lk, rk)) <= 5e-2 * max(1.0, rq.abs().max().item()),
                record,
                f"rotate in {dtype} differs from float32 by "
                f"{max(_maxdiff(lq, rq), _maxdiff(lk, rk)):.2e}",
            )
            le = embed(x.to(dtype), pos, f"{dtype} x")
            _expect(
                _maxdiff(le, ex) <= 5e-2 * max(1.0, ex.abs().max().item()),
                record,
                f"embed in {dtype} differs from float32 by {_maxdiff(le, ex):.2e}",
            )

    # Gradients flow through embed and rotate to their inputs and to every parameter.
    module.train()
    xg = x.detach().clone().requires_grad_(True)
    qg, kg = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    y = embed(xg, pos, "backward")
    rq2, rk2 = rotate(qg, kg, pos, "backward")
    loss = (y * _randn(gen, *y.shape, device=dev)).sum() + scores(rq2, rk2).tanh().sum()
    b = module.score_bias()
    if isinstance(b, DistanceBias) and isinstance(b.slopes, Tensor) and b.slopes.requires_grad:
        loss = loss + b.dense(4, 4).sum()
    loss.backward()
    _check_input_grad(record, xg, "x", "backward through embed")
    _check_input_grad(record, qg, "q", "backward through rotate")
    _check_input_grad(record, kg, "k", "backward through rotate")
    _check_grads(record, module, "backward through embed/rotate/score_bias")
    module.eval()
