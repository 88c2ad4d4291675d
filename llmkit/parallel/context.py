"""Context parallelism: causal attention over a sequence split across ranks (ring attention).

The sequence is cut into ``2·cp`` equal chunks and rank ``r`` of the context-parallel group
holds chunks ``r`` and ``2·cp−1−r`` (the load-balanced layout of torchtitan and Llama 3):
under a causal mask every rank then has the same amount of work. :func:`shard_indices`
gives a rank's global positions, :func:`shard_sequence` cuts a tensor, and
:func:`gather_sequence` puts the pieces back together.

:func:`ring_attention` computes exact causal attention of the rank's queries over the whole
sequence: the key/value shards travel around the ring of ranks by point-to-point send/recv
(gloo on CPU, nccl on CUDA), the next transfer overlapping the current block's compute.
Each block gives a partial output and its log-sum-exp, merged with the online-softmax rule;
query/key chunk pairs that the causal mask hides entirely are skipped (about half of them).
The backward runs the ring again, recomputing each block's probabilities from the saved
output and log-sum-exp (as flash attention does), the key/value gradient accumulators
travelling with the keys and values so that each rank ends with its own shard's gradient.
The block math is plain matmuls accumulated in fp32; bf16 inputs give bf16 outputs.

:class:`ContextParallel` bundles a group with this rank's place in it: what the model's
attention kernel calls when a context-parallel group is active.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from llmkit.errors import LlmkitError

__all__ = [
    "ContextParallel",
    "gather_sequence",
    "ring_attention",
    "shard_indices",
    "shard_sequence",
]

#: Point-to-point tags: the travelling keys/values and the travelling gradient accumulators
#: are distinct messages between the same two ranks (nccl ignores tags; gloo matches them).
_KV_TAG = 11
_GRAD_TAG = 12

_SKIP, _FULL, _PARTIAL = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------------------------


def shard_indices(T: int, cp: int, rank: int, device: torch.device | str | None = None) -> Tensor:
    """The global positions rank ``rank`` of ``cp`` holds, in its local order: chunks ``rank``
    and ``2·cp−1−rank`` of ``2·cp`` equal chunks of ``range(T)``."""
    if cp < 1 or not 0 <= rank < cp:
        raise LlmkitError(f"context-parallel rank {rank} is not in range(cp = {cp})")
    if T % (2 * cp):
        raise LlmkitError(
            f"sequence length {T} is not a multiple of 2·cp = {2 * cp} "
            "(context parallelism cuts it into 2·cp equal chunks)"
        )
    c = T // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def shard_sequence(t: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s part of ``t`` along ``dim`` (the sequence dimension)."""
    return t.index_select(dim, shard_indices(t.shape[dim], cp, rank, t.device))


def gather_sequence(t_local: Tensor, cp: int, rank: int, group: Any = None, dim: int = 1) -> Tensor:
    """The whole sequence from every rank's part (the inverse of :func:`shard_sequence`),
    on every rank. An all-gather without autograd: for tests and evaluation."""
    if cp == 1:
        return t_local
    parts = [torch.empty_like(t_local) for _ in range(cp)]
    dist.all_gather(parts, t_local.contiguous(), group=group)
    T = t_local.shape[dim] * cp
    order = torch.cat([shard_indices(T, cp, r, t_local.device) for r in range(cp)])
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order))


# ---------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------


def _fold(x: Tensor, hkv: int, rows: slice) -> Tensor:
    """``x[:, :, rows]`` of shape (B, Hq, t, ...) as (B, Hkv, G·t, ...): each key/value
    head's G query heads stacked along the rows, so that GQA is plain batched matmuls."""
    part = x[:, :, rows]
    B, Hq, t = part.shape[:3]
    return part.reshape(B, hkv, (Hq // hkv) * t, *part.shape[3:])


def _unfold(x: Tensor, hq: int) -> Tensor:
    """The inverse of :func:`_fold`: (B, Hkv, G·t, ...) → (B, Hq, t, ...)."""
    B, hkv, gt = x.shape[:3]
    return x.reshape(B, hq, gt * hkv // hq, *x.shape[3:])


class _Plan:
    """Which (query chunk, key chunk) pairs of each ring step the causal mask leaves visible.

    The local sequence is cut in two halves (one chunk of the load-balanced layout each);
    each pair is skipped, computed without a mask, or computed with its mask, decided from
    the positions' ranges on the host once per call."""

    def __init__(self, positions_q: Tensor, positions_k_all: Tensor, groups: int) -> None:
        tl = positions_q.shape[0]
        n = 2 if tl % 2 == 0 and tl > 1 else 1
        step = tl // n
        self.chunks = [slice(i * step, (i + 1) * step) for i in range(n)]
        self.groups = groups
        self.positions_q = positions_q
        self.positions_k_all = positions_k_all
        host_q = positions_q.detach().cpu()
        host_k = positions_k_all.detach().cpu()
        self.q_range = [(int(host_q[c].min()), int(host_q[c].max())) for c in self.chunks]
        self.k_range = [
            [(int(row[c].min()), int(row[c].max())) for c in self.chunks] for row in host_k
        ]

    def kind(self, src: int, a: int, b: int) -> int:
        """Whether query chunk ``a`` sees none, all or part of key chunk ``b`` of rank ``src``."""
        (q_lo, q_hi), (k_lo, k_hi) = self.q_range[a], self.k_range[src][b]
        if k_lo > q_hi:
            return _SKIP
        return _FULL if k_hi <= q_lo else _PARTIAL

    def visible(self, src: int) -> Iterator[tuple[int, slice, Tensor | None]]:
        """The (query chunk, key chunk) pairs of rank ``src``'s keys that the causal mask
        leaves visible: query chunk index, key chunk slice and the mask (None: all visible)."""
        for a in range(len(self.chunks)):
            for b, cb in enumerate(self.chunks):
                kind = self.kind(src, a, b)
                if kind != _SKIP:
                    yield a, cb, self.mask(src, a, b) if kind == _PARTIAL else None

    def mask(self, src: int, a: int, b: int) -> Tensor:
        """Query chunk ``a`` (folded: G copies) × key chunk ``b`` of rank ``src``: True where
        the key's position is at most the query's."""
        pq = self.positions_q[self.chunks[a]]
        pk = self.positions_k_all[src, self.chunks[b]]
        return (pk[None, :] <= pq[:, None]).repeat(self.groups, 1)


def _exchange(t: Tensor, group: Any, rank: int, cp: int, tag: int) -> tuple[Tensor, list[Any]]:
    """Send ``t`` to the next rank of the ring and receive the previous rank's into a new
    buffer; returns the buffer and the requests to wait on."""
    buffer = torch.empty_like(t)
    ops = [
        dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % cp, tag=tag),
        dist.P2POp(dist.irecv, buffer, group=group, group_peer=(rank - 1) % cp, tag=tag),
    ]
    return buffer, dist.batch_isend_irecv(ops)


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """One block's softmax-normalised output and log-sum-exp (fp32; rows that see no key:
    output 0, log-sum-exp −inf)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v) / torch.where(total > 0, total, torch.ones_like(total))
    return out, (m + torch.log(total)).squeeze(-1)


def _merge(acc: tuple[Tensor, Tensor] | None, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """The online-softmax merge of two partial results over disjoint keys."""
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new = torch.logaddexp(acc_lse, lse)
    ref = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    w_acc = torch.exp(acc_lse - ref).unsqueeze(-1)
    w_new = torch.exp(lse - ref).unsqueeze(-1)
    return acc_out * w_acc + out * w_new, new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        plan: _Plan,
        scale: float,
        group: Any,
        rank: int,
        cp: int,
    ) -> Tensor:
        hq = q.shape[1]
        hkv = k.shape[1]
        qs = [_fold(q, hkv, c).float() for c in plan.chunks]
        acc: list[tuple[Tensor, Tensor] | None] = [None] * len(plan.chunks)
        kv = torch.stack([k, v])
        for step in range(cp):
            src = (rank - step) % cp
            incoming = _exchange(kv, group, rank, cp, _KV_TAG) if step + 1 < cp else None
            kf = vf = None
            for a, cb, mask in plan.visible(src):
                if kf is None or vf is None:
                    kf, vf = kv[0].float(), kv[1].float()
                o, lse = _block_forward(qs[a], kf[:, :, cb], vf[:, :, cb], mask, scale)
                acc[a] = _merge(acc[a], o, lse)
            if incoming is not None:
                buffer, requests = incoming
                _wait(requests)
                kv = buffer
        outs, lses = [], []
        for a, qa in enumerate(qs):
            pair = acc[a]
            if pair is None:  # these queries see no key at all
                pair = (torch.zeros_like(qa), torch.full(qa.shape[:-1], -math.inf, device=q.device))
            outs.append(_unfold(pair[0], hq))
            lses.append(_unfold(pair[1], hq))
        out = torch.cat(outs, 2).to(q.dtype)
        lse = torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.group, ctx.rank, ctx.cp = plan, scale, group, rank, cp
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        plan: _Plan = ctx.plan
        scale, group, rank, cp = ctx.scale, ctx.group, ctx.rank, ctx.cp
        hq, hkv = q.shape[1], k.shape[1]
        delta = (dout.float() * out.float()).sum(-1)  # rowsum(dO∘O)
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        qs = [_fold(q, hkv, c).float() for c in plan.chunks]
        dos = [_fold(dout, hkv, c).float() for c in plan.chunks]
        lses = [_fold(lse, hkv, c).unsqueeze(-1) for c in plan.chunks]
        deltas = [_fold(delta, hkv, c).unsqueeze(-1) for c in plan.chunks]
        dqs = [torch.zeros_like(qa) for qa in qs]
        kv = torch.stack([k, v])
        grads: tuple[Tensor, list[Any]] | None = None  # the accumulator on its way here
        for step in range(cp):
            src = (rank - step) % cp
            incoming = _exchange(kv, group, rank, cp, _KV_TAG) if step + 1 < cp else None
            dkv: Tensor | None = None  # this step's contribution to block src's gradient
            kf = vf = None
            for a, cb, mask in plan.visible(src):
                if kf is None or vf is None:
                    kf, vf = kv[0].float(), kv[1].float()
                    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
                assert dkv is not None
                kb, vb = kf[:, :, cb], vf[:, :, cb]
                s = torch.matmul(qs[a], kb.transpose(-1, -2)) * scale
                if mask is not None:
                    s = s.masked_fill(~mask, -math.inf)
                p = torch.exp(s - lses[a])
                dp = torch.matmul(dos[a], vb.transpose(-1, -2))
                ds = p * (dp - deltas[a])
                dqs[a] += torch.matmul(ds, kb) * scale
                dkv[0][:, :, cb] += torch.matmul(ds.transpose(-1, -2), qs[a]) * scale
                dkv[1][:, :, cb] += torch.matmul(p.transpose(-1, -2), dos[a])
            if grads is not None:
                buffer, requests = grads
                _wait(requests)
                dkv = buffer if dkv is None else buffer + dkv
            if dkv is None:
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            if cp == 1:
                break
            # Block src's accumulator goes on to the next rank, which holds block src next
            # step; after the last step it arrives home.
            grads = _exchange(dkv, group, rank, cp, _GRAD_TAG)
            if incoming is not None:
                buffer, requests = incoming
                _wait(requests)
                kv = buffer
        if grads is not None:
            dkv, requests = grads
            _wait(requests)
        assert dkv is not None
        dq = torch.cat([_unfold(d, hq) for d in dqs], 2).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Any = None,
    positions_q: Tensor,
    positions_k: Tensor,
    scale: float | None = None,
) -> Tensor:
    """Causal attention of this rank's queries over the keys/values of every rank of
    ``group`` (None: the default group), passed around the ring.

    ``q``: (B, Hq, Tl, D); ``k``, ``v``: (B, Hkv, Tl, D), the rank's shards, ``Hq`` a
    multiple of ``Hkv`` (query head ``h`` reads key/value head ``h // (Hq/Hkv)``).
    ``positions_q``/``positions_k``: (Tl,) global positions of the local rows; a query
    attends the keys whose position is at most its own. Every rank must pass the same
    shapes. Returns (B, Hq, Tl, D) in ``q``'s dtype; differentiable in q, k and v."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise LlmkitError(
            f"ring attention takes q (B, Hq, T, D) and k, v (B, Hkv, T, D); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise LlmkitError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    cp = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if cp > 1 else 0
    positions_k = positions_k.to(q.device)
    if cp > 1:
        everyone = [torch.empty_like(positions_k) for _ in range(cp)]
        dist.all_gather(everyone, positions_k.contiguous(), group=group)
        positions_k_all = torch.stack(everyone)
    else:
        positions_k_all = positions_k[None]
    plan = _Plan(positions_q.to(q.device), positions_k_all, hq // hkv)
    return _RingAttention.apply(q, k, v, plan, scale, group, rank, cp)


@dataclass
class ContextParallel:
    """A context-parallel group and this rank's place in it (``cp`` ranks, ``rank`` among
    them): how the model shards its sequence and computes attention over it."""

    group: Any
    cp: int
    rank: int

    @classmethod
    def from_group(cls, group: Any = None) -> ContextParallel:
        """This rank's view of ``group`` (None: the default group)."""
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def shard(self, t: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of ``t`` along the sequence dimension ``dim``."""
        return shard_sequence(t, self.cp, self.rank, dim)

    def gather(self, t: Tensor, dim: int = 1) -> Tensor:
        """The whole sequence from every rank's part (no autograd)."""
        return gather_sequence(t, self.cp, self.rank, self.group, dim)

    def positions(self, T: int, device: torch.device | str | None = None) -> Tensor:
        """The global positions of this rank's part of a length-``T`` sequence."""
        return shard_indices(T, self.cp, self.rank, device)

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: float | None = None
    ) -> Tensor:
        """Causal attention of the local q/k/v shards (B, H, Tl, D) at global ``positions``
        over the whole sequence: :func:`ring_attention` on this group."""
        return ring_attention(
            q, k, v, group=self.group, positions_q=positions, positions_k=positions, scale=scale
        )
