"""Compile the attention Triton kernels for NVIDIA GPUs ahead of time, without a GPU.

The CPU interpreter (``TRITON_INTERPRET=1``, what the tests run) hides what only the GPU
compiler sees: ``tl.dot`` shape and dtype rules, shared memory over the per-block limit,
register spills. This script runs the real Python wrapper
(the custom operators ``llmkit::flash_attention_fwd``/``_bwd``, forward then backward, with
the tile sizes :func:`~llmkit.kernels.flash_attention.block_config` picks on a GPU) on
empty CPU tensors; every kernel launch is intercepted and compiled by ``triton.compile`` for
a ``GPUTarget`` (PTX, then a cubin through the ``ptxas`` bundled with Triton) instead of
being run. For each compiled kernel it reports the shared memory against the arch's opt-in
per-block limit and, from ``cuobjdump -res-usage``, registers and stack (a stack frame
means register spills).

    python -m benchmarks.scripts.aot_compile_check [--arch 80,86,90] [--full] [--json OUT]

Default matrix: bf16 and fp32 (IEEE and TF32 dots) × head dim 32/64/128/256 × (causal,
ALiBi, padding mask all on | all off | a causal window: the kernels
:mod:`llmkit.kernels.sliding_window` runs), each sm. ``--full`` adds fp16 and every causal ×
ALiBi × padding combination (fp16 compiles like bf16; the flags barely move the resources).
Exit status 0 when everything compiles within the limits, 1 otherwise. About 3-6 min of
compiling per arch by default (triton 3.9 on a 2-core machine; triton 3.6 is faster; cached
kernels are instant), ~4× that with ``--full``. Works with triton 3.6 (the CUDA image's)
to 3.9; compiling with the triton a GPU machine has is the closer check.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # block_config must pick the GPU tiles

import torch

#: Opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes.
SMEM_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}


def _resources(cubin: bytes) -> dict[str, int]:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    line = next((ln for ln in res.stdout.splitlines() if "REG:" in ln), "")
    fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    return {k.lower(): int(fields[k]) for k in ("REG", "STACK", "LOCAL") if k in fields}


@contextlib.contextmanager
def compiling_for(arch: int, sink: list[dict[str, Any]], tag: dict[str, Any]) -> Iterator[None]:
    """Within the block, a Triton kernel launch compiles for ``sm_<arch>`` and records the
    result in ``sink`` (with ``tag``) instead of running."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime import jit

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        # What JITFunction.run does before compiling, with our target's backend.
        kwargs["debug"] = kwargs.get("debug", self.debug) or triton.knobs.runtime.debug
        comp = triton.knobs.compilation
        kwargs["instrumentation_mode"] = comp.instrumentation_mode
        if hasattr(comp, "fpsan_homomorphic_casts"):  # triton ≥ 3.7
            kwargs["fpsan_homomorphic_casts"] = comp.fpsan_homomorphic_casts
        binder = jit.create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound, specialization, options
        )
        names = [p.name for p in self.params]
        consts = {names[k[0]]: v for k, v in constexprs.items()}
        rec = {**tag, "kernel": self.fn.__name__.strip("_").removesuffix("_kernel"),
               "arch": arch, "triton": triton.__version__, "num_warps": options.num_warps,
               "num_stages": options.num_stages, "tiles": (consts.get("BLOCK_M"),
               consts.get("BLOCK_N"), consts.get("BLOCK_D"))}  # fmt: skip
        t = time.monotonic()
        try:
            kernel = triton.compile(
                ASTSource(self, signature, constexprs, attrs), target=target,
                options=options.__dict__,
            )  # fmt: skip
            rec["shared"] = kernel.metadata.shared
            rec.update(_resources(kernel.asm["cubin"]))
            over = rec["shared"] > SMEM_LIMIT.get(arch, 101376)
            rec["error"] = "shared memory over the per-block limit" if over else None
        except Exception as exc:
            text = str(exc).strip().splitlines()
            rec["shared"], rec["error"] = None, f"{type(exc).__name__}: {' '.join(text)[-600:]}"
        rec["compile_s"] = round(time.monotonic() - t, 2)
        sink.append(rec)

    saved = jit.JITFunction.run
    jit.JITFunction.run = run
    try:
        yield
    finally:
        jit.JITFunction.run = saved


def launch_flash(dtype: torch.dtype, head_dim: int, causal: bool, alibi: bool, pad: bool,
                 tf32: bool = False, batch: int = 2, heads: int = 4, groups: int = 1,
                 tq: int = 1024, tk: int = 1024, window: int | None = None) -> None:  # fmt: skip
    """Forward and backward through the wrapper on empty CPU tensors (kernels intercepted)."""
    from llmkit.kernels import flash_attention as fa

    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        q = torch.empty(batch, heads, tq, head_dim, dtype=dtype, requires_grad=True)
        kv = (batch, heads // groups, tk, head_dim)
        k = torch.empty(kv, dtype=dtype, requires_grad=True)
        v = torch.empty(kv, dtype=dtype, requires_grad=True)
        assert fa.kernel_supports(q, k, v)
        slopes = torch.full((heads,), 0.5) if alibi else None
        mask = torch.ones(batch, tk, dtype=torch.bool) if pad else None
        kpm = fa._padding_bytes(mask, batch, tk, q.device)
        out, lse = fa.flash_attention_fwd(q, k, v, slopes, kpm, causal, window or 0, 0, 0)
        fa.flash_attention_bwd(
            torch.empty_like(out), q, k, v, out, lse, slopes, kpm, causal, window or 0, 0, 0
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def flash_matrix(full: bool) -> list[dict[str, Any]]:
    dtypes = ["float16"] if full else []
    dtypes += ["bfloat16", "float32", "float32-tf32"]
    flags = list(itertools.product((True, False), repeat=3))
    if not full:
        flags = [(True, True, True), (False, False, False)]
    cases = []
    for dt, d, (causal, alibi, pad) in itertools.product(dtypes, (32, 64, 128, 256), flags):
        cases.append({"dtype": dt, "D": d, "causal": causal, "alibi": alibi, "pad": pad})
    # The sliding-window variant (HAS_WINDOW), as attention.sliding_window launches it.
    for dt, d in itertools.product(dtypes, (32, 64, 128, 256)):
        cases.append({"dtype": dt, "D": d, "causal": True, "alibi": False, "pad": False,
                      "window": 256})  # fmt: skip
    # Shape specializations: ragged lengths, decoding (Tq = 1), GQA, odd head dims.
    for dt, d in itertools.product(("bfloat16", "float32"), (16, 96)):
        cases.append({"dtype": dt, "D": d, "causal": True, "alibi": False, "pad": True,
                      "tq": 1, "tk": 1000, "groups": 4})  # fmt: skip
        cases.append({"dtype": dt, "D": d, "causal": False, "alibi": True, "pad": False,
                      "tq": 257, "tk": 257, "groups": 2})  # fmt: skip
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="80,86,90", help="comma-separated sm numbers")
    parser.add_argument("--full", action="store_true", help="fp16 and every flag combination")
    parser.add_argument("--json", help="write every record to this file")
    args = parser.parse_args(argv)
    records: list[dict[str, Any]] = []
    for arch in (int(a) for a in args.arch.split(",")):
        for case in flash_matrix(args.full):
            dt = case["dtype"]
            kwargs = {k: case[k] for k in ("tq", "tk", "groups", "window") if k in case}
            with compiling_for(arch, records, case):
                launch_flash(getattr(torch, dt.removesuffix("-tf32")), case["D"], case["causal"],
                             case["alibi"], case["pad"], tf32=dt.endswith("-tf32"),
                             **kwargs)  # fmt: skip
            for rec in records[-4:]:
                if rec["error"]:
                    print(f"FAIL sm_{arch} {case} {rec['kernel']}: {rec['error']}", flush=True)
    print(summary(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 1 if any(r["error"] for r in records) else 0


def summary(records: list[dict[str, Any]]) -> str:
    """One line per (arch, dtype, head dim, kernel): tiles, shared memory, registers, stack."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["arch"], r["dtype"], r["D"], r["kernel"]), []).append(r)
    lines = ["| sm | dtype | D | kernel | BLOCK M×N×D | warps/stages | ok | shared KiB "
             "(limit) | regs | stack B |", "|" + "---|" * 10]  # fmt: skip
    for (arch, dt, d, kernel), rs in sorted(groups.items(), key=lambda kv: kv[0]):
        r0 = rs[0]
        ok = sum(not r["error"] for r in rs)
        smem = [r["shared"] for r in rs if r["shared"] is not None]
        regs = [r.get("reg", -1) for r in rs]
        stack = [r.get("stack", -1) for r in rs]
        tiles = "×".join(str(t) for t in r0["tiles"] if t is not None)
        lines.append(
            f"| {arch} | {dt} | {d} | {kernel} | {tiles} | {r0['num_warps']}/{r0['num_stages']} "
            f"| {ok}/{len(rs)} | {max(smem, default=0) / 1024:.0f} "
            f"({SMEM_LIMIT.get(arch, 101376) // 1024}) | {min(regs)}–{max(regs)} "
            f"| {min(stack)}–{max(stack)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
