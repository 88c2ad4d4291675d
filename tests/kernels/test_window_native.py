"""The compiled CPU sliding-window kernel (llmkit.kernels.window_native): outputs and
gradients against float64 autograd through the naive reference, on this CPU's build and on
an AVX2 build; the component's dispatch to it; its build, cache and fallbacks."""

from __future__ import annotations

import platform
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from llmkit.components.attention.sliding_window import (
    SlidingWindowAttention,
    SlidingWindowOptions,
    sliding_window_attention,
)
from llmkit.components.position.alibi import alibi_slopes
from llmkit.contracts import DistanceBias
from llmkit.kernels import block_local, native_build, window_native, worker_threads
from tests.components.test_attention import _grads_vs_reference, make_qkv, naive


@pytest.fixture
def lib():
    """This machine's build of the kernel (it needs a C compiler and AVX2 with FMA)."""
    built = window_native.library()
    if built is None:
        pytest.skip(f"compiled window kernel unavailable: {window_native.unavailable_reason()}")
    return built


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """An empty kernel cache and no loaded library; the module's state is restored after."""
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(tmp_path / "cache"))
    saved = dict(window_native.KERNEL._state)
    window_native.forget()
    yield tmp_path
    window_native.forget()
    window_native.KERNEL._state.update(saved)


@pytest.fixture
def count_calls(monkeypatch):
    """Counts of kernel calls by the component: {"native": n, "block_local": m}."""
    calls = {"native": 0, "block_local": 0}
    native, blocks = window_native._WindowNative.apply, block_local.block_local_attention

    def spy_native(*args):
        calls["native"] += 1
        return native(*args)

    def spy_blocks(*args, **kwargs):
        calls["block_local"] += 1
        return blocks(*args, **kwargs)

    monkeypatch.setattr(window_native._WindowNative, "apply", spy_native)
    monkeypatch.setattr(
        "llmkit.components.attention.sliding_window.block_local_attention", spy_blocks
    )
    return calls


CASES = [  # b, hq, hkv, tq, tk, window, d
    (1, 2, 2, 64, 64, 16, 64),  # tiles cut windows; Tq a multiple of no tile height
    (2, 4, 2, 37, 37, 300, 32),  # GQA; window longer than the sequence
    (1, 3, 1, 29, 80, 24, 64),  # MQA; Tq < Tk (queries at the end of the keys)
    (1, 2, 2, 45, 45, 1, 32),  # window 1: each query sees only itself
    (2, 2, 2, 3, 200, 50, 128),  # short query block at the end of a long cache
    (1, 2, 2, 100, 100, 7, 96),  # head dim three product steps wide (AVX-512)
]


def _slopes(hq: int, alibi: str) -> torch.Tensor | None:
    """None, ALiBi's slopes, or ALiBi's with the first head's slope 0 (no bias there)."""
    if alibi == "plain":
        return None
    slopes = torch.tensor(alibi_slopes(hq))
    if alibi == "mixed":
        slopes[0] = 0.0
    return slopes


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("alibi", ["plain", "alibi", "mixed"])
def test_matches_reference(lib, count_calls, case, alibi):
    """Output, dq, dk, dv of the component's function on fp32 CPU tensors: the compiled
    kernel runs, within fp32 rounding of float64 autograd (with ALiBi, and with heads with
    and without a bias in one call)."""
    b, hq, hkv, tq, tk, window, d = case
    q, k, v = make_qkv(b, hq, hkv, tq, tk, d=d, seed=tq + window)
    slopes = _slopes(hq, alibi)
    _grads_vs_reference(q, k, v, window, slopes=slopes, seed=3)
    assert count_calls == {"native": 1, "block_local": 0}


@pytest.mark.parametrize("alibi", ["plain", "alibi"])
def test_huge_scores_outside_the_window_change_nothing(lib, alibi):
    """Keys just after a query (the future) or just before its window score far above every
    key inside it: the softmax max is taken inside the window only, else the row's terms
    underflow to nothing; the gradients too."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, d=64, seed=9)
    window = 16
    unit = q / q.norm(dim=-1, keepdim=True)
    k[:, :, 1:] += 200.0 * unit[:, :, :-1]  # key i+1: logit ≈ 200 for query i, outside
    k[:, :, :-window] += 200.0 * unit[:, :, window:]  # key i−W: the same for query i
    slopes = _slopes(2, alibi)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = window_native.window_attention_native(*ins, window, 1, slopes)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(10))
    ref_ins = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = naive(*ref_ins, slopes=slopes, window=window)
    got = (out, *torch.autograd.grad(out, ins, grad))
    want = (ref, *torch.autograd.grad(ref, ref_ins, grad.double()))
    # fp32 logits near 200 carry ~1e-5 of rounding; over 200 seeds the worst gradient error
    # was 1.9e-4. A max taken outside the window is off by O(1).
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=5e-4, rtol=1e-4)


def test_work_buffers_are_written_before_they_are_read(lib):
    """The C calls driven directly with NaN-filled work buffers (two threads' worth) give the
    component's results bit for bit."""
    b, hq, hkv, tq, tk, window, d = 2, 4, 2, 37, 50, 20, 64
    q, k, v = make_qkv(b, hq, hkv, tq, tk, d=d, seed=5)
    slopes = _slopes(hq, "mixed")
    grad = torch.randn_like(q)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = window_native.window_attention_native(*ins, window, hq // hkv, slopes)
    want = (out, *torch.autograd.grad(out, ins, grad))
    keys, scale = min(tk, tq + window - 1), d**-0.5
    o, lse = torch.empty_like(q), torch.empty(b, hq, tq)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    ptr = [t.data_ptr() for t in (q, k, v, slopes, o, grad, lse, dq, dk, dv)]
    shape = (0, b * hkv, hkv, hq // hkv, tq, tk, d, window, scale)
    for backward in (0, 1):
        floats = lib.llmkit_window_work(keys, d, window, backward)
        work = torch.full((2 * floats,), float("nan"))
        if backward:
            lib.llmkit_window_backward(*ptr, *shape, work.data_ptr(), floats, 2)
        else:
            lib.llmkit_window_forward(*ptr[:5], ptr[6], *shape, work.data_ptr(), floats, 2)
    for got, expected in zip((o, dq, dk, dv), want):
        assert torch.equal(got, expected)


def test_threads_give_the_inline_results(lib, monkeypatch):
    """The (batch, kv head) pairs on worker threads give the inline results bit for bit."""
    q, k, v = make_qkv(2, 4, 2, 70, 70, d=64, seed=1)
    grad = torch.randn_like(q)
    results = []
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for parallel in (1 << 62, 0):
            monkeypatch.setattr(worker_threads, "PARALLEL_SCORES", parallel)
            ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = window_native.window_attention_native(*ins, 20, 2)
            results.append((out, *torch.autograd.grad(out, ins, grad)))
    finally:
        torch.set_num_threads(before)
    for inline, threaded in zip(*results):
        assert torch.equal(inline, threaded)


def _loaded_gomp() -> list[str]:
    """Paths of the OpenMP runtimes (libgomp) mapped into this process (Linux)."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "libgomp" in line.split()[-1]})


def test_openmp_build_runs_on_torchs_runtime(lib, tmp_path):
    """Where the compiler has OpenMP the library is built with it, and where torch's own
    OpenMP runtime is ``libgomp.so.1`` (its Linux wheels) the kernel binds to that one: a
    single libgomp in the process, so its threads are torch's."""
    try:
        flags = native_build.FLAGS + native_build.OPENMP
        window_native.KERNEL.build(native_build.compiler(), flags, tmp_path)
    except RuntimeError:
        pytest.skip("this compiler has no OpenMP")
    assert lib.llmkit_window_openmp() == 1
    assert "OpenMP threads" in window_native.describe()
    if platform.system() != "Linux":
        return
    loaded = _loaded_gomp()
    if any(Path(path).name == "libgomp.so.1" for path in loaded):
        assert len(loaded) == 1, loaded


def test_a_build_without_openmp_runs_pairs_on_worker_threads(lib, monkeypatch, tmp_path):
    """A build without OpenMP gives the OpenMP build's results bit for bit, its pairs on
    Python worker threads."""
    cc = native_build.compiler()
    serial = window_native.KERNEL.load_file(
        window_native.KERNEL.build(cc, native_build.FLAGS, tmp_path)
    )
    assert serial.llmkit_window_openmp() == 0
    runs = []

    def spy(*args):
        runs.append(args)
        return real(*args)

    real = worker_threads.run_parts
    monkeypatch.setattr(window_native, "run_parts", spy)
    monkeypatch.setattr(worker_threads, "PARALLEL_SCORES", 0)
    q, k, v = make_qkv(2, 4, 2, 70, 70, d=64, seed=2)
    grad = torch.randn_like(q)
    slopes = torch.tensor(alibi_slopes(4))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results = []
        for built in (lib, serial):
            ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = window_native.window_attention_native(*ins, 20, 2, slopes, lib=built)
            results.append((out, *torch.autograd.grad(out, ins, grad)))
    finally:
        torch.set_num_threads(before)
    assert [(len(parts), workers) for parts, workers, _ in runs] == [(4, 2), (4, 2)]
    for openmp, threads in zip(*results):
        assert torch.equal(openmp, threads)


def test_a_compiler_without_openmp_still_builds_it(fresh_state, monkeypatch):
    """A compiler that rejects -fopenmp: the library is built without it, runs, and is
    loaded from the cache next time."""
    cc = native_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    script = fresh_state / "noomp"
    script.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && '
        "{ echo 'error: unsupported option -fopenmp' >&2; exit 1; }; done\n"
        f'exec {shlex.join(cc)} "$@"\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    built = window_native.library()
    assert built is not None, window_native.unavailable_reason()
    assert built.llmkit_window_openmp() == 0
    assert "Python worker threads" in window_native.describe()
    (rejected,) = (fresh_state / "cache" / "kernels").glob("*.rejected")
    assert "unsupported option -fopenmp" in rejected.read_text()
    q, k, v = make_qkv(1, 2, 2, 40, 40, d=64, seed=4)
    got = window_native.window_attention_native(q, k, v, 9, 1, lib=built)
    torch.testing.assert_close(got.double(), naive(q, k, v, window=9), atol=2e-6, rtol=0)
    # The next process loads that build from the cache without trying -fopenmp again.
    window_native.forget()

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    again = window_native.library()
    assert again is not None and again.llmkit_window_openmp() == 0


def test_a_one_off_build_failure_is_not_remembered(fresh_state, monkeypatch):
    """A compile that times out (or crashes) leaves no mark: the next process builds with
    OpenMP again."""
    cc = native_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    try:
        window_native.KERNEL.build(cc, native_build.FLAGS + native_build.OPENMP, fresh_state)
    except RuntimeError:
        pytest.skip("this compiler has no OpenMP")
    real = window_native.KERNEL.build

    def timeout_once(cc, flags=native_build.FLAGS, directory=None):
        if native_build.OPENMP[0] in flags:
            raise RuntimeError("cc did not finish: timed out")
        return real(cc, flags, directory)

    monkeypatch.setattr(window_native.KERNEL, "build", timeout_once)
    assert window_native.library().llmkit_window_openmp() == 0
    assert not list((fresh_state / "cache" / "kernels").glob("*.rejected"))
    window_native.forget()
    monkeypatch.setattr(window_native.KERNEL, "build", real)
    assert window_native.library().llmkit_window_openmp() == 1


def test_a_build_that_does_not_load_falls_back_to_the_other(fresh_state, monkeypatch):
    """A cached OpenMP build this process cannot load (its runtime missing here): the build
    without OpenMP runs; if nothing loads, the reason says so."""
    cc = native_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    real = window_native.KERNEL.load_file

    def no_openmp_runtime(path):
        if path == window_native.KERNEL.built_path(cc, native_build.FLAGS + native_build.OPENMP):
            raise OSError("libomp.so: cannot open shared object file")
        return real(path)

    monkeypatch.setattr(window_native.KERNEL, "load_file", no_openmp_runtime)
    built = window_native.library()
    assert built is not None and built.llmkit_window_openmp() == 0
    window_native.forget()

    def nothing_loads(path):
        raise OSError("cannot open shared object file")

    monkeypatch.setattr(window_native.KERNEL, "load_file", nothing_loads)
    assert window_native.library() is None
    assert window_native.unavailable_reason() == "load failed: cannot open shared object file"


def test_an_unreadable_source_is_a_reason_not_an_error(fresh_state, monkeypatch):
    """A failure before any compiler runs (the source missing, the cache unreadable) turns
    the kernel off with the reason; the PyTorch path runs."""
    monkeypatch.setattr(window_native.KERNEL, "source", fresh_state / "missing.c")
    q, k, v = make_qkv(1, 2, 2, 24, 24, d=64)
    got = sliding_window_attention(q, k, v, 8)
    torch.testing.assert_close(got, naive(q, k, v, window=8).float(), atol=2e-6, rtol=0)
    assert window_native.library() is None
    assert window_native.unavailable_reason().startswith("build failed: ")
    assert "missing.c" in window_native.unavailable_reason()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_compute_in_fp32(lib, count_calls, dtype):
    """fp16/bf16 inputs run in fp32 and come back, with their gradients, in their dtype and
    within that dtype's rounding of float64 autograd."""
    q, k, v = (t.to(dtype) for t in make_qkv(1, 4, 2, 40, 40, d=64, seed=2))
    slopes = torch.tensor(alibi_slopes(4))
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = sliding_window_attention(*ins, 12, bias=DistanceBias(slopes))
    grad = torch.randn(out.shape).to(dtype)
    grads = torch.autograd.grad(out, ins, grad)
    ref_ins = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = naive(*ref_ins, window=12, slopes=slopes)
    ref_grads = torch.autograd.grad(ref, ref_ins, grad.double())
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
    assert count_calls["native"] == 1


def test_other_calls_take_the_pytorch_path(lib, count_calls):
    """Key padding, dropout, an explicit chunk, float64 and odd head dims are the block-local
    path's."""
    q, k, v = make_qkv(1, 2, 2, 24, 24, d=64)
    pad = torch.ones(1, 24, dtype=torch.bool)
    pad[0, :3] = False
    sliding_window_attention(q, k, v, 8, key_padding_mask=pad)
    sliding_window_attention(q, k, v, 8, dropout_p=0.1)
    sliding_window_attention(q, k, v, 8, chunk=8)
    sliding_window_attention(q.double(), k.double(), v.double(), 8)
    sliding_window_attention(*make_qkv(1, 2, 2, 24, 24, d=8), 8)
    assert count_calls == {"native": 0, "block_local": 5}
    sliding_window_attention(q, k, v, 8)
    assert count_calls == {"native": 1, "block_local": 5}


def test_turned_off_by_the_environment(lib, monkeypatch, count_calls):
    monkeypatch.setenv(native_build.ENV, "0")
    q, k, v = make_qkv(1, 2, 2, 24, 24, d=64)
    torch.testing.assert_close(
        sliding_window_attention(q, k, v, 8), naive(q, k, v, window=8).float(), atol=2e-6, rtol=0
    )
    assert count_calls == {"native": 0, "block_local": 1}
    assert window_native.library() is None
    assert "LLMKIT_NATIVE_KERNELS" in window_native.unavailable_reason()
    assert "unavailable: turned off" in SlidingWindowAttention.runtime_backend()


def test_tensors_elsewhere_and_another_default_device(lib, count_calls):
    """Keys or values off the CPU are not the kernel's; its own buffers are CPU fp32 whatever
    torch's default device and dtype."""
    q, k, v = make_qkv(1, 2, 2, 24, 24, d=64)
    assert not window_native.supports(q, k.to("meta"), v, None, 0.0)
    assert not window_native.supports(q, k, v.to("meta"), None, 0.0)
    want = naive(q, k, v, window=8).float()
    torch.set_default_device("meta")
    torch.set_default_dtype(torch.float64)
    try:
        got = sliding_window_attention(q, k, v, 8)
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    assert count_calls["native"] == 1


def test_slopes_must_be_one_per_query_head(lib):
    q, k, v = make_qkv(1, 4, 2, 24, 24, d=64)
    with pytest.raises(ValueError, match="window must be"):
        window_native.window_attention_native(q, k, v, 0, 2)
    for slopes in (torch.ones(3), torch.ones(2), torch.ones(4, 1)):
        with pytest.raises(ValueError, match="one per query head"):
            window_native.window_attention_native(q, k, v, 8, 2, slopes)


def test_component_uses_it_and_says_so(lib, count_calls):
    """The component (the registry's ``sliding_window``) runs the kernel on fp32 CPU tensors
    and ``llmkit show`` names it."""
    layer = SlidingWindowAttention(SlidingWindowOptions(window=16), None)
    q, k, v = make_qkv(1, 4, 2, 50, 50, d=64, seed=4)
    out = layer(q, k, v, bias=DistanceBias(torch.tensor(alibi_slopes(4))))
    torch.testing.assert_close(
        out.double(),
        naive(q, k, v, window=16, slopes=torch.tensor(alibi_slopes(4))),
        atol=2e-6,
        rtol=0,
    )
    assert count_calls["native"] == 1
    assert "window_native" in SlidingWindowAttention.runtime_backend()


def test_decoding_works_on_the_last_keys_only(lib):
    """A query block at the end of a long cache transposes and buffers only the keys its
    windows reach: the work buffer does not grow with the cache."""
    d, window = 64, 32
    small = lib.llmkit_window_work(min(100, 1 + window - 1), d, window, 1)
    assert small < 4 * d * (window + 64) + 4096
    q, k, v = make_qkv(1, 2, 2, 1, 5000, d=d, seed=5)
    got = window_native.window_attention_native(q, k, v, window, 1)
    torch.testing.assert_close(got.double(), naive(q, k, v, window=window), atol=2e-6, rtol=0)


@pytest.fixture(scope="module")
def avx2_lib(tmp_path_factory):
    """The AVX2 build (8 lanes, 6-row tiles) a CPU without AVX-512 compiles; it runs here
    wherever AVX2 and FMA do, whatever else this CPU has."""
    flags = native_build.cpu_flags().split()
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= set(flags):
        pytest.skip("needs an x86-64 CPU with AVX2 and FMA")
    cc = native_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    avx2 = (*native_build.FLAGS[:-1], "-mavx2", "-mfma")
    built = window_native.KERNEL.load_file(
        window_native.KERNEL.build(cc, avx2, tmp_path_factory.mktemp("avx2"))
    )
    assert built.llmkit_window_lanes() == 16
    return built


AVX2_CASES = [  # b, hq, hkv, tq, tk, window, d, alibi
    (2, 4, 2, 61, 75, 20, 48, True),  # GQA, Tq < Tk, 6-row tiles cut at 61
    (1, 2, 2, 40, 40, 100, 16, False),  # one product step of head dims; window past Tk
    (1, 3, 1, 1, 90, 7, 32, True),  # decoding one query, MQA
]


@pytest.mark.parametrize("case", AVX2_CASES, ids=lambda c: "-".join(map(str, c)))
def test_an_avx2_build_matches_too(avx2_lib, case, monkeypatch):
    """The AVX2 build (without OpenMP), its pairs on two worker threads."""
    monkeypatch.setattr(worker_threads, "PARALLEL_SCORES", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_avx2_case(avx2_lib, case)
    finally:
        torch.set_num_threads(before)


def _check_avx2_case(avx2_lib, case):
    b, hq, hkv, tq, tk, window, d, alibi = case
    q, k, v = make_qkv(b, hq, hkv, tq, tk, d=d, seed=6)
    slopes = torch.tensor(alibi_slopes(hq)) if alibi else None
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = window_native.window_attention_native(*ins, window, hq // hkv, slopes, lib=avx2_lib)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, ins, grad)
    ref_ins = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = naive(*ref_ins, slopes=slopes, window=window)
    ref_grads = torch.autograd.grad(ref, ref_ins, grad.double())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)


def test_build_is_cached_per_source_compiler_and_cpu(fresh_state, monkeypatch):
    """The first call compiles into the cache; later loads reuse the file (no compiler run);
    the name changes with the flags."""
    cc = native_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    first = window_native.KERNEL.build(cc)
    assert first.parent == fresh_state / "cache" / "kernels" and first.exists()

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert window_native.KERNEL.build(cc) == first
    assert window_native.KERNEL.library_name(cc, native_build.FLAGS[:-1]) != first.name
    assert window_native.KERNEL.library_name(["ccache", *cc], native_build.FLAGS) != first.name
    assert not list(first.parent.glob("*.tmp"))


def test_no_compiler_or_a_failed_build_falls_back(fresh_state, monkeypatch, count_calls):
    """Without a compiler, or with one that fails, the PyTorch path runs and the reason is
    kept; a failing compiler's error line is in it."""
    q, k, v = make_qkv(1, 2, 2, 24, 24, d=64)
    want = naive(q, k, v, window=8).float()
    monkeypatch.setenv("CC", "no-such-compiler-here")
    torch.testing.assert_close(sliding_window_attention(q, k, v, 8), want, atol=2e-6, rtol=0)
    assert window_native.unavailable_reason() == "CC=no-such-compiler-here not found"
    window_native.forget()
    script = fresh_state / "badcc"
    script.write_text("#!/bin/sh\necho 'fatal error: no such header' >&2\nexit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    torch.testing.assert_close(sliding_window_attention(q, k, v, 8), want, atol=2e-6, rtol=0)
    assert (
        window_native.unavailable_reason()
    ) == "build failed: badcc failed: fatal error: no such header"
    assert count_calls == {"native": 0, "block_local": 2}
    with pytest.raises(RuntimeError, match="unavailable"):
        window_native.window_attention_native(q, k, v, 8, 1)


def test_memory_is_linear_in_length(lib):
    """Forward+backward keeps q, k, v, the output, one log-sum-exp per row and per-thread
    buffers of O(W·D) plus one head's transposed keys and values: the peak grows with L
    like the O(L·D) tensors, never like L²."""
    from llmkit.bench.kernels.timing import cpu_peak_allocated

    def peak(length: int) -> int:
        q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 2, 2, length, length, d=64))

        def step():
            out = window_native.window_attention_native(q, k, v, 64, 1)
            return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

        step()
        return cpu_peak_allocated(step)

    small, large = peak(2048), peak(4096)
    assert large <= 2.2 * small, (small, large)
    # Outputs (out, dq, dk, dv, lse) and the buffers: far below one head's L×L scores.
    assert large < 12 * 2 * 4096 * 64 * 4, large


def test_cc_may_carry_a_launcher(fresh_state, monkeypatch):
    """``CC="ccache gcc"``-style commands keep every word."""
    cc = native_build.compiler()
    if cc is None or shutil.which("env") is None:
        pytest.skip("no C compiler or no env")
    monkeypatch.setenv("CC", f"env {cc[0]}")
    assert native_build.compiler() == [shutil.which("env"), cc[0]]
    assert window_native.library() is not None, window_native.unavailable_reason()


def test_custom_ops_pass_opcheck(lib):
    """Under torch.compile the kernel runs as llmkit::window_native_fwd/_bwd: schema, fake
    tensors, autograd registration and AOT dispatch."""
    q, k, v = (t.detach() for t in make_qkv(2, 4, 2, 21, 21, 32, seed=3))
    slopes = torch.tensor(alibi_slopes(4), dtype=torch.float32)
    for s in (None, slopes):
        args = (q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), s, 6, 2)
        result = torch.library.opcheck(torch.ops.llmkit.window_native_fwd.default, args)
        assert set(result.values()) == {"SUCCESS"}, result
    out, lse = window_native.window_native_fwd(q.detach(), k.detach(), v.detach(), None, 6, 2)
    grad = torch.randn_like(out)
    args = (grad, q.detach(), k.detach(), v.detach(), out, lse, None, 6, 2)
    result = torch.library.opcheck(torch.ops.llmkit.window_native_bwd.default, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_compiles_with_fullgraph_and_matches_eager(lib, count_calls):
    """torch.compile must not trace into the ctypes calls (it once handed the kernel fake
    addresses and corrupted memory): the component compiles with fullgraph=True, runs the
    operator, and matches eager outputs and gradients."""
    torch._dynamo.reset()
    q, k, v = make_qkv(2, 4, 2, 40, 40, 32, seed=4)

    def run(fn):
        ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*ins, 9)
        out.backward(torch.ones_like(out))
        return out.detach(), *(t.grad for t in ins)

    want = run(sliding_window_attention)
    eager_calls = count_calls["native"]
    got = run(torch.compile(sliding_window_attention, fullgraph=True, backend="aot_eager"))
    assert count_calls["native"] == eager_calls == 1  # the compiled call takes the operator
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
