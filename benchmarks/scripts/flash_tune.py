"""Tile sweep for the Triton kernels on one GPU: which launch settings are fastest here.

    python -m benchmarks.scripts.flash_tune [--out DIR] [--budget S] [--dry-run]

For flash attention (causal, bf16, 4 × 4096 tokens, 2048 = H·D wide, D 64 and 128), each
kernel is timed with candidate tiles (BLOCK_M, BLOCK_N, warps, stages) while the other two
keep the table's (:data:`llmkit.kernels.flash_attention.TILE_OVERRIDES`): the forward alone,
and the backward (δ, dK/dV, dQ) for the dK/dV and dQ candidates. The table's own tiles are
timed with and without the interior-block mask skip
(:data:`~llmkit.kernels.flash_attention.SKIP_INTERIOR_MASKS`). Candidates that do not compile
(shared memory, registers) are reported as such. For RMSNorm (4096 and 16384 tokens × 4096,
bf16, forward + backward) the warps per row and the backward's programs per SM are swept,
next to PyTorch's RMSNorm.

Timings are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed). Writes
``flash_tune.json`` (every record) and prints one line per record; rewritten after every
record, so a run cut short keeps what it measured. ``--dry-run`` checks the script's logic on
the CPU (no kernel runs): it lists the candidates it would time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

FWD = (
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 32, 4, 3),
    (64, 64, 4, 3),
    (128, 64, 4, 4),
    (64, 128, 4, 3),
)
DKDV = (
    (32, 128, 4, 3),
    (32, 128, 8, 2),
    (64, 128, 8, 3),
    (64, 64, 4, 3),
    (32, 64, 4, 3),
    (16, 128, 4, 3),
    (64, 128, 4, 2),
    (32, 128, 4, 5),
)
DQ = (
    (128, 32, 4, 3),
    (128, 32, 8, 2),
    (128, 64, 8, 3),
    (64, 64, 4, 3),
    (64, 32, 4, 3),
    (128, 64, 4, 2),
    (128, 32, 4, 5),
)
NORM = ((256, 4), (512, 4), (128, 4), (256, 1), (256, 2), (256, 8), (512, 8))
#: Sliding-window candidates (W = WINDOW): smaller query tiles waste less of the band.
WFWD = ((128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 4))
WDKDV = ((32, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (16, 64, 4, 3))
WDQ = ((128, 32, 4, 3), (64, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3))
WINDOW = 512
HEAD_DIMS = (64, 128)
SEQ = 4096
BATCH = 4


def _flops(b: int, h: int, n: int, d: int, mode: str, window: int = 0) -> float:
    """Causal attention FLOPs on attended pairs (a window attends min(i+1, W) keys)."""
    w = min(window or n, n)
    pairs = w * (w + 1) / 2 + max(n - w, 0) * w
    fwd = 4 * b * h * pairs * d
    return fwd if mode == "fwd" else 2.5 * fwd


class Recorder:
    def __init__(self, out: Path) -> None:
        self.path = out / "flash_tune.json"
        self.records: list[dict[str, Any]] = []

    def add(self, **record: Any) -> None:
        self.records.append(record)
        print(json.dumps(record), flush=True)
        self.path.write_text(json.dumps(self.records, indent=1))


def tune_flash(rec: Recorder, deadline: float, dry: bool) -> None:
    for window in (0, WINDOW):
        for d in HEAD_DIMS:
            if dry:
                cands = (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ))
                if window:
                    cands = (("fwd", WFWD), ("dkdv", WDKDV), ("dq", WDQ))
                for kernel, tiles in cands:
                    for c in tiles:
                        rec.add(kind="flash", kernel=kernel, D=d, W=window, tiles=c, dry_run=True)
            else:
                _tune_flash_at(rec, deadline, d, window)


def _tune_flash_at(rec: Recorder, deadline: float, d: int, window: int) -> None:
    from llmkit.kernels import flash_attention as fa

    h = 2048 // d
    import triton.testing

    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    # (B, T, H, D) buffers viewed as (B, H, T, D), as the model's projections give them.
    q, k, v = (rand(BATCH, SEQ, h, d).transpose(1, 2) for _ in range(3))
    do = rand(BATCH, SEQ, h, d).transpose(1, 2)
    args = (None, None, True, window, 0, 0)

    def fwd():
        return fa._forward(q, k, v, *args)

    o, lse = fwd()

    def bwd():
        return fa._backward(do, q, k, v, o, lse, *args)

    def bench(kernel: str, fn, tiles, skip: bool = True) -> None:
        if time.monotonic() > deadline:
            return
        fa.TILE_OVERRIDES.clear()
        if tiles is not None:
            fa.TILE_OVERRIDES[kernel] = fa.BlockConfig(*tiles)
        fa.SKIP_INTERIOR_MASKS = skip
        mode = "fwd" if kernel == "fwd" else "bwd"
        try:
            ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
        except Exception as exc:  # out of shared memory / registers
            rec.add(
                kind="flash",
                kernel=kernel,
                D=d,
                W=window,
                tiles=tiles,
                skip_masks=skip,
                error=f"{type(exc).__name__}: {str(exc)[:120]}",
            )
            return
        finally:
            fa.TILE_OVERRIDES.clear()
            fa.SKIP_INTERIOR_MASKS = True
        rec.add(
            kind="flash",
            kernel=kernel,
            D=d,
            W=window,
            tiles=tiles,
            skip_masks=skip,
            ms=round(ms, 4),
            tflops=round(_flops(BATCH, h, SEQ, d, mode, window) / ms / 1e9, 1),
        )

    for skip in (True, False):
        bench("fwd", fwd, None, skip)
        bench("bwd", bwd, None, skip)
    plan = (("fwd", fwd, FWD), ("dkdv", bwd, DKDV), ("dq", bwd, DQ))
    if window:
        plan = (("fwd", fwd, WFWD), ("dkdv", bwd, WDKDV), ("dq", bwd, WDQ))
    for kernel, fn, cands in plan:
        for tiles in cands:
            bench(kernel, fn, tiles)
    if window:
        return
    try:  # SDPA's flash backend on the same inputs, for scale
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            f = torch.nn.functional.scaled_dot_product_attention
            ms_f = triton.testing.do_bench(
                lambda: f(qs, ks, vs, is_causal=True), warmup=10, rep=40, return_mode="median"
            )
            out = f(qs, ks, vs, is_causal=True)
            ms_b = triton.testing.do_bench(
                lambda: torch.autograd.grad(out, (qs, ks, vs), do, retain_graph=True),
                warmup=10,
                rep=40,
                return_mode="median",
            )
        for mode, ms in (("fwd", ms_f), ("bwd", ms_b)):
            rec.add(
                kind="sdpa-flash",
                kernel=mode,
                D=d,
                ms=round(ms, 4),
                tflops=round(_flops(BATCH, h, SEQ, d, mode, window) / ms / 1e9, 1),
            )
    except Exception as exc:
        rec.add(kind="sdpa-flash", D=d, error=f"{type(exc).__name__}: {str(exc)[:120]}")


def tune_rmsnorm(rec: Recorder, deadline: float, dry: bool) -> None:
    for tokens in (4096, 16384):
        if dry:
            for width, per_sm in NORM:
                rec.add(
                    kind="rmsnorm", tokens=tokens, width_per_warp=width, per_sm=per_sm, dry_run=True
                )
        else:
            _tune_rmsnorm_at(rec, deadline, tokens)


def _tune_rmsnorm_at(rec: Recorder, deadline: float, tokens: int) -> None:
    import triton.testing

    from llmkit.kernels import rmsnorm as rk

    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step(fn):
        return lambda: torch.autograd.grad(fn(), (x, w), dy)

    def torch_norm():
        r = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        return (x.float() * r).to(x.dtype) * w

    ms = triton.testing.do_bench(step(torch_norm), warmup=10, rep=40, return_mode="median")
    rec.add(kind="rmsnorm-torch", tokens=tokens, ms=round(ms, 4))
    for width, per_sm in NORM:
        if time.monotonic() > deadline:
            return
        rk.WIDTH_PER_WARP, rk.BWD_PROGRAMS_PER_SM = width, per_sm
        try:
            ms = triton.testing.do_bench(
                step(lambda: rk.rms_norm_triton(x, w, 1e-5)),
                warmup=10,
                rep=40,
                return_mode="median",
            )
            rec.add(
                kind="rmsnorm",
                tokens=tokens,
                width_per_warp=width,
                per_sm=per_sm,
                ms=round(ms, 4),
            )
        except Exception as exc:
            rec.add(
                kind="rmsnorm",
                tokens=tokens,
                width_per_warp=width,
                per_sm=per_sm,
                error=f"{type(exc).__name__}: {str(exc)[:120]}",
            )
        finally:
            rk.WIDTH_PER_WARP, rk.BWD_PROGRAMS_PER_SM = 256, 4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-check"))
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for the whole sweep")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument(
        "--tiles",
        type=Path,
        help="write the fastest tiles found as a JSON file for LLMKIT_FLASH_TILES",
    )
    a = ap.parse_args(argv)
    if not a.dry_run and not torch.cuda.is_available():
        print("flash_tune: no CUDA GPU")
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(a.out)
    deadline = time.monotonic() + a.budget
    tune_rmsnorm(rec, deadline, a.dry_run)
    tune_flash(rec, deadline, a.dry_run)
    best: dict[str, Any] = {}
    for r in rec.records:
        if r.get("kind") == "flash" and "ms" in r and r.get("tiles"):
            key = f"{r['kernel']}-D{r['D']}-W{int(bool(r['W']))}"
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    for key, r in sorted(best.items()):
        print(f"best {key}: tiles {r['tiles']} {r['ms']} ms")
    if a.tiles is not None:
        tiles = {key: list(r["tiles"]) for key, r in best.items()}
        a.tiles.write_text(json.dumps(tiles, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
