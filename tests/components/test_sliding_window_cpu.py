"""The block-local sliding-window path (llmkit.kernels.block_local): its three
ways of running (fused forward or step by step, inline or on worker threads) against the
float64 reference, outputs and gradients; the layouts it views in place; and its memory,
O(L·D) in the autograd graph and O(L·W) at most in any intermediate."""

from __future__ import annotations

import math
import multiprocessing
import os

import pytest
import torch

from llmkit.bench.kernels.timing import cpu_peak_allocated
from llmkit.components.attention.sliding_window import sliding_window_attention
from llmkit.components.position.alibi import alibi_slopes
from llmkit.kernels import block_local, worker_threads
from tests.components.test_attention import (
    _grads_vs_reference,
    _largest,
    left_padding,
    make_qkv,
    naive,
)


@pytest.fixture(autouse=True)
def _block_local_only(monkeypatch):
    """These tests are the block-local path's: the compiled kernel (which takes fp32 calls
    with head dims a multiple of its vector step) is off (tests/kernels/test_window_native.py
    has its own)."""
    monkeypatch.setenv("LLMKIT_NATIVE_KERNELS", "0")


@pytest.fixture
def two_threads():
    """Two torch threads (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _check(q, k, v, window, **kwargs):
    """Output and dq, dk, dv against float64 autograd through the naive reference."""
    return _grads_vs_reference(q, k, v, window, seed=7, **kwargs)


CASES = [  # b, hq, hkv, tq, tk, window, chunk
    (1, 4, 4, 64, 64, 16, 8),  # Tq = Tk = nb·C: q, k, v, out and gradients viewed in place
    (2, 4, 2, 70, 70, 16, 8),  # GQA, padded last chunk
    (2, 2, 2, 40, 90, 24, 8),  # Tq < Tk: dummy queries in front
    (1, 6, 3, 96, 96, 7, 4),  # window not a multiple of the chunk
    (2, 4, 1, 48, 48, 200, 8),  # window longer than the sequence (MQA)
    (2, 2, 2, 6, 50, 16, None),  # one chunk per head (Tq ≤ C)
    (1, 2, 2, 33, 33, 1, 8),  # window 1: n = 0
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("fused", [True, False], ids=["fused-fwd", "step-fwd"])
@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threads"])
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_paths_match_reference(monkeypatch, two_threads, case, fused, threaded, alibi):
    """Every way of running, forward and backward, with small steps (several per head, steps
    across head boundaries, heads' first chunks split between steps)."""
    b, hq, hkv, tq, tk, window, chunk = case
    monkeypatch.setattr(block_local, "FUSED_FORWARD", fused)
    monkeypatch.setattr(worker_threads, "PARALLEL_SCORES", 0 if threaded else 1 << 62)
    monkeypatch.setattr(block_local, "STEP_SCORES", 3 * 8 * 32)
    q, k, v = make_qkv(b, hq, hkv, tq, tk, d=8, seed=tq + window)
    slopes = torch.tensor(alibi_slopes(hq)) if alibi else None
    _check(q, k, v, window, slopes=slopes, chunk=chunk)


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threads"])
@pytest.mark.parametrize("step_scores", [1, 1 << 18], ids=["chunk-steps", "big-steps"])
def test_padding_with_empty_rows(monkeypatch, two_threads, threaded, step_scores):
    """Key padding (step-by-step forward) including rows that see no key, on every path."""
    monkeypatch.setattr(worker_threads, "PARALLEL_SCORES", 0 if threaded else 1 << 62)
    monkeypatch.setattr(block_local, "STEP_SCORES", step_scores)
    q, k, v = make_qkv(3, 4, 2, 40, 52, d=8, seed=3)
    pad = left_padding(3, 52, [0, 20, 30])  # sample 2: its first queries see only padding
    slopes = torch.tensor(alibi_slopes(4))
    _check(q, k, v, 12, slopes=slopes, pad=pad, chunk=8)


@pytest.mark.parametrize("tq", [32, 16], ids=["nb>n", "nb=n"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-fwd", "step-fwd"])
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_steps_over_many_heads(monkeypatch, two_threads, tq, fused, alibi):
    """Steps holding more than two heads mask the spans before each head's first key with
    the gathered per-chunk rows (every chunk from n on reads the all-False last row);
    forward and backward against the reference, GQA and MQA."""
    monkeypatch.setattr(block_local, "FUSED_FORWARD", fused)
    monkeypatch.setattr(worker_threads, "PARALLEL_SCORES", 1 << 62)
    monkeypatch.setattr(block_local, "STEP_SCORES", 1 << 18)
    for hq, hkv in ((8, 4), (4, 1)):
        q, k, v = make_qkv(5, hq, hkv, tq, tq, d=8, seed=tq + hkv)
        lay = block_local.Layout(q, k, 16, hq // hkv, None, None, 8)
        steps = lay.steps(0, lay.chunks)
        assert max((f1 - 1) // lay.nb - f0 // lay.nb + 1 for f0, f1 in steps) > 2
        assert lay.front_rows.shape[0] == min(lay.n, lay.nb) + 1
        slopes = torch.tensor(alibi_slopes(hq)) if alibi else None
        _check(q, k, v, 16, slopes=slopes, chunk=8)


def test_layout_masks_stay_small():
    """At the benchmark's shape the masks the calling thread builds stay under torch's grain
    size (no OpenMP region there, whose team would spin on a core while the workers run):
    they do not grow with L."""
    grain = 32768  # at::internal::GRAIN_SIZE
    for length in (4096, 16384):
        q, k, _ = make_qkv(1, 8, 8, length, length, d=64)
        lay = block_local.Layout(q, k, 256, 1, None, None, None)
        assert lay.front_rows.numel() < grain and lay.bias.numel() < grain
        assert lay.front_rows.shape == (lay.n + 1, 1, lay.kc) and not lay.front_rows[-1].any()


def test_threads_give_the_inline_results(monkeypatch, two_threads):
    """Worker threads compute the same numbers as the inline path, run after run, and leave
    the caller's torch thread count as it was."""
    q, k, v = make_qkv(2, 4, 4, 256, 256, d=16, seed=1)
    monkeypatch.setattr(block_local, "STEP_SCORES", 1 << 12)
    monkeypatch.setattr(worker_threads, "PARALLEL_SCORES", 1 << 62)
    inline = _check(q, k, v, 32, chunk=16)
    monkeypatch.setattr(worker_threads, "PARALLEL_SCORES", 0)
    lay = block_local.Layout(q, k, 32, 1, None, None, 16)
    assert lay.workers == 2 and len(lay.parts) > 2
    runs = [_check(q, k, v, 32, chunk=16) for _ in range(2)]
    assert torch.get_num_threads() == 2
    for a, b in zip((runs[0][0], *runs[0][1]), (runs[1][0], *runs[1][1]), strict=True):
        assert torch.equal(a, b)  # deterministic
    for a, b in zip((inline[0], *inline[1]), (runs[0][0], *runs[0][1]), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_worker_errors_reach_the_caller(monkeypatch, two_threads):
    monkeypatch.setattr(worker_threads, "PARALLEL_SCORES", 0)
    monkeypatch.setattr(block_local, "STEP_SCORES", 1)
    q, k, _ = make_qkv(1, 4, 4, 64, 64, d=8)
    lay = block_local.Layout(q, k, 16, 1, None, None, 8)
    assert lay.workers == 2 and len(lay.parts) == 4

    def work(p0: int, p1: int, state: dict) -> None:
        if p0 > 0:
            raise RuntimeError(f"part {p0}")

    with pytest.raises(RuntimeError, match="part"):
        worker_threads.run_parts(lay.parts, lay.workers, work)
    assert torch.get_num_threads() == 2


def test_expanded_and_transposed_gradients():
    """The backward views query rows and dO with as_strided: an expanded upstream gradient
    (``out.sum().backward()``) and (B, T, H, D)-transposed inputs must still be right."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, d=8, seed=4)
    _check(q, k, v, 16, chunk=8, grad=torch.ones(()).expand(1, 2, 64, 8))
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    _check(qt, kt, vt, 16, chunk=8)


def test_dtypes():
    """fp64 stays fp64 (both forwards); bf16 is computed in fp32 and cast back."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, d=8, seed=5)
    _check(q.double(), k.double(), v.double(), 16, chunk=8, atol=1e-10)
    low = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
    out = sliding_window_attention(*low, 16, chunk=8)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in low)
    torch.testing.assert_close(
        out.double(), naive(*(t.detach() for t in low), window=16), atol=2e-2, rtol=0
    )


def test_views_in_place():
    """Tq = Tk = nb·C, fp32, contiguous, one kv head per query head: q, k, v are read and
    the output written without copies (the layout's flags), and the results are right."""
    q, k, _ = make_qkv(1, 4, 4, 128, 128, d=8)
    lay = block_local.Layout(q, k, 32, 1, None, None, 16)
    assert lay.q_view and lay.k_view and not lay.single and lay.first == 0
    keys = block_local.Keys(lay, k)
    assert keys.flat.data_ptr() == k.data_ptr()
    assert lay.queries(q).data_ptr() == q.data_ptr()
    # GQA rows are copied; 8 dummy queries in front of Tq = 120 fill Tk = 128 = nb·C.
    q2, k2, _ = make_qkv(1, 4, 2, 120, 128, d=8)
    lay2 = block_local.Layout(q2, k2, 32, 2, None, None, 16)
    assert not lay2.q_view and lay2.k_view and lay2.pre == 8
    # Keys before the last Tq + W − 1 are not read at all: a padded copy of the others.
    q3, k3, _ = make_qkv(1, 2, 2, 120, 300, d=8)
    lay3 = block_local.Layout(q3, k3, 32, 1, None, None, 16)
    assert not lay3.q_view and not lay3.k_view and (lay3.pre, lay3.first) == (31, 149)


def _peak_bytes(length: int, window: int, heads: int = 2, d: int = 16) -> int:
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, heads, heads, length, length, d=d))
    grad = torch.randn(q.shape)

    def step():
        out = sliding_window_attention(q, k, v, window)
        return torch.autograd.grad(out, (q, k, v), grad)

    step()
    return cpu_peak_allocated(step)


def test_peak_memory_is_linear_in_length(monkeypatch):
    """Forward+backward's peak allocation (the CPU allocator's running total) doubles at
    most when L doubles at a fixed window, and stays far below one L×L score matrix; the
    largest single intermediate does not grow with L at all beyond the O(L·D) tensors.
    (Small steps, so that the fixed step buffers do not hide the O(L·D) part.)"""
    monkeypatch.setattr(block_local, "STEP_SCORES", 1 << 16)
    window, heads, d = 64, 2, 16
    small, large = _peak_bytes(2048, window, heads, d), _peak_bytes(4096, window, heads, d)
    assert large <= 2.2 * small, (small, large)
    assert large * 16 < heads * 4096 * 4096 * 4
    linear = heads * 4096 * d  # elements of one of q, k, v
    q, k, v = make_qkv(1, heads, heads, 4096, 4096, d=d)
    largest = _largest(lambda q, k, v: sliding_window_attention(q, k, v, window), q, k, v)
    step = block_local.STEP_SCORES * block_local.Layout(q, k, window, 1, None, None, None).stride
    assert largest <= max(linear, step), (largest, linear)


def test_default_chunk():
    assert block_local.default_chunk(256) == 32
    assert block_local.default_chunk(4096) == 32
    assert block_local.default_chunk(40) == 20
    assert block_local.default_chunk(1) == 8
    lay = block_local.Layout(*make_qkv(1, 8, 8, 4096, 4096, d=64)[:2], 256, 1, None, None, None)
    assert (lay.c, lay.n, lay.kc) == (32, 8, 288)  # 1.125× the useful scores
    assert math.isclose(lay.kc / 256, 1.125)


def test_large_windowed_call_uses_the_threads(two_threads):
    """At the benchmark's shape (B 1, H 8, L 4096, W 256) on 2 threads: 2 workers over 8
    parts of one head, the fused forward, q, k, v viewed in place."""
    q, k, _ = make_qkv(1, 8, 8, 4096, 4096, d=64)
    lay = block_local.Layout(q, k, 256, 1, None, None, None)
    assert lay.workers == 2 and len(lay.parts) == 8
    assert lay.fused == (block_local._FUSED is not None)
    assert lay.q_view and lay.k_view


def _in_child(queue) -> None:
    # Tiny tensors: no op opens an OpenMP region (GNU OpenMP hangs in a forked child that
    # does), but the call still runs on worker threads.
    torch.set_num_threads(2)
    worker_threads.PARALLEL_SCORES, block_local.STEP_SCORES = 0, 1
    q, k, v = make_qkv(1, 4, 4, 64, 64, d=8)
    lay = block_local.Layout(q, k, 16, 1, None, None, 8)
    assert lay.workers == 2 and len(lay.parts) == 4
    out = sliding_window_attention(q, k, v, 16, chunk=8)
    torch.set_num_threads(1)
    queue.put(float((out.double() - naive(q, k, v, window=16)).abs().max()))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_threads_work_in_a_forked_child(monkeypatch, two_threads):
    """The worker pool of the parent is not inherited by a forked child (a DataLoader
    worker, say): the child makes its own instead of waiting on threads that do not exist."""
    monkeypatch.setattr(worker_threads, "PARALLEL_SCORES", 0)
    monkeypatch.setattr(block_local, "STEP_SCORES", 1)
    q, k, v = make_qkv(1, 4, 4, 64, 64, d=8)
    sliding_window_attention(q, k, v, 16, chunk=8)  # the parent's pool exists now
    assert worker_threads._POOL is not None
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_child, args=(queue,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung")
    assert child.exitcode == 0
    assert queue.get(timeout=5) < 1e-5
