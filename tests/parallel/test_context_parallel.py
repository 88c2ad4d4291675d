"""Context parallelism (llmkit.parallel.context): load-balanced sharding and ring attention.

Real gloo groups of 2 and 4 CPU processes (spawned once per world size for the whole module)
run every case and save their shards' outputs and gradients; the tests compare them with
full-sequence causal attention computed here in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmkit.errors import LlmkitError
from llmkit.parallel.context import (
    ContextParallel,
    ring_attention,
    shard_indices,
    shard_sequence,
)
from tests.helpers import init_gloo, spawn_workers


@dataclass(frozen=True)
class Case:
    name: str
    hq: int = 4
    hkv: int = 4
    T: int = 16
    dtype: torch.dtype = torch.float32
    scale: float | None = None
    wrong_positions: bool = False  # contiguous positions, not the shard's: must not match
    strided: bool = False  # over cp = 2 subgroups {0, 2} and {1, 3} of a 4-process world
    B: int = 2
    D: int = 8


CASES: dict[int, list[Case]] = {
    2: [
        Case("mha"),
        Case("gqa", hkv=2),
        Case("mqa", hkv=1),
        Case("scale", hkv=2, scale=0.5),
        Case("bf16", hkv=2, dtype=torch.bfloat16),
        Case("wrong_positions", hkv=2, wrong_positions=True),
    ],
    4: [
        Case("mha", T=32),
        Case("gqa", hkv=2, T=32),
        Case("mqa", hkv=1, T=32),
        Case("strided_gqa", hkv=2, strided=True),
    ],
}
EXACT = [(w, c) for w, cases in CASES.items() for c in cases if c.name != "wrong_positions"]
FP32 = [(w, c) for w, c in EXACT if c.dtype == torch.float32]


def make_inputs(case: Case) -> tuple[torch.Tensor, ...]:
    """The whole sequence's q, k, v (in the case's dtype) and the loss weights (fp32)."""
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(case.B, case.hq, case.T, case.D, generator=g)
    k = torch.randn(case.B, case.hkv, case.T, case.D, generator=g)
    v = torch.randn(case.B, case.hkv, case.T, case.D, generator=g)
    w = torch.randn(case.B, case.hq, case.T, case.D, generator=g)
    return q.to(case.dtype), k.to(case.dtype), v.to(case.dtype), w


def reference(case: Case, causal: bool = True) -> dict[str, torch.Tensor]:
    """Full-sequence attention in fp32 (keys/values repeated for GQA) and its gradients."""
    q, k, v, w = (t.float().requires_grad_() for t in make_inputs(case))
    groups = case.hq // case.hkv
    out = F.scaled_dot_product_attention(
        q,
        k.repeat_interleave(groups, 1),
        v.repeat_interleave(groups, 1),
        is_causal=causal,
        scale=case.scale,
    )
    (out * w).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _worker(rank: int, world: int, tmp: str) -> None:
    init_gloo(rank, world, tmp)
    try:
        # every rank creates every subgroup, in the same order
        strided = [dist.new_group([i, i + 2]) for i in range(2)] if world == 4 else []
        for case in CASES[world]:
            cp = ContextParallel.from_group(strided[rank % 2] if case.strided else None)
            q, k, v, w = make_inputs(case)
            positions = cp.positions(case.T)
            if case.wrong_positions:
                tl = case.T // cp.cp
                positions = torch.arange(cp.rank * tl, (cp.rank + 1) * tl)
            ql, kl, vl = (cp.shard(t, dim=2).requires_grad_() for t in (q, k, v))
            out = cp.attention(ql, kl, vl, positions, scale=case.scale)
            assert out.dtype == case.dtype and out.shape == ql.shape
            (out.float() * cp.shard(w, dim=2)).sum().backward()
            grads = [t.grad for t in (ql, kl, vl)]
            assert all(g is not None and g.dtype == case.dtype for g in grads)
            result = dict(zip(("dq", "dk", "dv"), grads, strict=True))
            result |= {
                "cp": cp.cp,
                "cp_rank": cp.rank,
                "idx": cp.positions(case.T),
                "out": out.detach(),
                "gathered": cp.gather(out.detach(), dim=2),
                "round_trip": cp.gather(cp.shard(q, dim=2), dim=2),
            }
            torch.save(result, Path(tmp) / f"{case.name}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp: Path) -> Path:
    """Run :func:`_worker` on ``world`` processes; fail (never hang) after two minutes."""
    spawn_workers(_worker, (world, str(tmp)), world, "context-parallel")
    return tmp


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory):
    """``ran(world)``: the directory of the ``world``-process run's results (run once)."""
    done: dict[int, Path] = {}

    def get(world: int) -> Path:
        if world not in done:
            done[world] = _spawn(world, tmp_path_factory.mktemp(f"cp{world}"))
        return done[world]

    return get


def results(ran, world: int, case: Case) -> list[dict]:
    return [torch.load(ran(world) / f"{case.name}-{r}.pt") for r in range(world)]


def _id(param: tuple[int, Case]) -> str:
    return f"world{param[0]}-{param[1].name}"


def test_shard_indices_are_the_load_balanced_permutation():
    assert shard_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert shard_indices(8, 1, 0).tolist() == list(range(8))
    for T, cp in [(16, 2), (32, 4), (24, 3), (8, 4)]:
        every = torch.cat([shard_indices(T, cp, r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(T))
    x = torch.arange(2 * 16 * 3).view(2, 16, 3)
    assert torch.equal(shard_sequence(x, 4, 1, dim=1), x[:, [2, 3, 12, 13]])
    with pytest.raises(LlmkitError, match="multiple of 2·cp"):
        shard_indices(12, 4, 0)
    with pytest.raises(LlmkitError, match="not in range"):
        shard_indices(16, 2, 2)


def test_one_rank_is_plain_causal_attention():
    """Without a process group: an odd length (one chunk), GQA, and queries that see no key
    (output 0, finite gradients)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 7, 8, generator=g).requires_grad_() for h in (4, 2, 2))
    positions = torch.arange(7)
    out = ring_attention(q, k, v, positions_q=positions, positions_k=positions)
    out.sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, enable_gqa=True)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for mine, theirs in [(q, q2), (k, k2), (v, v2)]:
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)
    late = ring_attention(q, k, v, positions_q=positions, positions_k=positions + 3)
    late.sum().backward()
    assert torch.equal(late[:, :, :3], torch.zeros_like(late[:, :, :3]))
    shifted = F.scaled_dot_product_attention(
        q[:, :, 3:], k[:, :, :4], v[:, :, :4], is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(late[:, :, 3:], shifted, atol=1e-5, rtol=1e-5)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("world", [2, 4])
def test_shard_gather_round_trip(ran, world):
    case = CASES[world][0]
    q = make_inputs(case)[0]
    for r in results(ran, world, case):
        assert torch.equal(r["round_trip"], q)


@pytest.mark.parametrize(("world", "case"), FP32, ids=[_id(p) for p in FP32])
def test_forward_matches_full_causal_attention(ran, world, case):
    ref = reference(case)["out"]
    for r in results(ran, world, case):
        torch.testing.assert_close(r["out"], ref[:, :, r["idx"]], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["gathered"], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("world", "case"), FP32, ids=[_id(p) for p in FP32])
def test_gradients_match_full_causal_attention(ran, world, case):
    ref = reference(case)
    for r in results(ran, world, case):
        for name in ("dq", "dk", "dv"):
            torch.testing.assert_close(
                r[name], ref[name][:, :, r["idx"]], atol=1e-5, rtol=1e-5, msg=name
            )


def test_bf16_is_close_and_stays_bf16(ran):
    case = next(c for c in CASES[2] if c.dtype == torch.bfloat16)
    ref = reference(case)  # fp32 on the same (bf16-rounded) inputs
    for r in results(ran, 2, case):
        for name in ("out", "dq", "dk", "dv"):
            assert r[name].dtype == torch.bfloat16
            torch.testing.assert_close(
                r[name].float(), ref[name][:, :, r["idx"]], atol=1e-2, rtol=1e-2, msg=name
            )


def test_the_causal_mask_follows_global_positions(ran):
    """The result is neither bidirectional attention nor what contiguous positions give."""
    case = next(c for c in CASES[2] if c.name == "gqa")
    causal, full = reference(case)["out"], reference(case, causal=False)["out"]
    assert (causal - full).abs().max() > 0.1  # the comparison below can tell them apart
    for r in results(ran, 2, case):
        assert (r["out"] - full[:, :, r["idx"]]).abs().max() > 0.1
    wrong = next(c for c in CASES[2] if c.wrong_positions)
    for r in results(ran, 2, wrong):
        assert (r["out"] - causal[:, :, r["idx"]]).abs().max() > 0.1
