"""What document masking costs on a CPU: attention forward+backward with packed documents
against the plain causal call, for the ``sdpa`` component and the alternatives it was chosen
over, and a whole training step of a small model.

    python -m benchmarks.scripts.document_mask_cost [--rounds 30] [--threads N]

Attention: (B, H, L, D) = (8, 4, 256, 32), each row cut into four documents at random
points, fp32 and bf16 (the component widens bf16 calls with heads ≤ 32 wide to fp32).
Variants: ``causal`` (the component without documents, SDPA's ``is_causal`` path),
``mask`` (the component with ``document_ids``: one boolean block-diagonal causal mask),
``per_document`` (one causal SDPA call per document and row) and ``flex`` (torch's
flex_attention with a block mask, compiled; reported as unavailable where it has no CPU
backward). Step: a 4-layer, d_model 128 model, batch 8 × 256 tokens, forward, backward and
an AdamW step, with and without ``document_ids``. Variants run interleaved, one iteration
each per round, and the medians are reported, so a busy machine slows them alike.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmkit.components.attention.options import SDPAttentionOptions
from llmkit.components.attention.sdpa import SDPAttention
from llmkit.contracts import BuildContext
from llmkit.model import build_model, document_ids_from_bounds
from llmkit.spec import load_spec_dict

B, H, L, D = 8, 4, 256, 32


def _documents(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = [(torch.randperm(length - 1, generator=gen)[:3] + 1).tolist() for _ in range(batch)]
    return document_ids_from_bounds([sorted(s) for s in starts], length)


def _per_document(q, k, v, ids):
    rows = []
    for b in range(q.shape[0]):
        bounds = [0, *(torch.nonzero(torch.diff(ids[b])).flatten() + 1).tolist(), q.shape[2]]
        parts = [
            F.scaled_dot_product_attention(
                q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e], is_causal=True
            )
            for s, e in itertools.pairwise(bounds)
        ]
        rows.append(torch.cat(parts, 2))
    return torch.cat(rows)


def _flex(ids) -> Callable | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def same_document(b, h, qi, ki):
            return (ids[b, qi] == ids[b, ki]) & (qi >= ki)

        mask = create_block_mask(same_document, B, None, L, L, device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)
        q = torch.randn(B, H, L, D, requires_grad=True)
        compiled(q, q, q, block_mask=mask).sum().backward()
    except Exception as exc:  # reported, not raised
        print(f"flex: unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
        return None
    return lambda q, k, v: compiled(q, k, v, block_mask=mask)


def _median_ms(variants: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    for fn in variants.values():  # warm up
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def attention(rounds: int) -> None:
    ctx = BuildContext(
        d_model=H * D, n_heads=H, n_kv_heads=H, head_dim=D, max_seq_len=L, n_layers=1
    )
    kernel = SDPAttention(SDPAttentionOptions(), ctx)
    ids = _documents(B, L)
    flex = _flex(ids)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(B, H, L, D, dtype=dtype, requires_grad=True) for _ in range(3))

        def step(fn, q=q, k=k, v=v):
            return lambda: fn(q, k, v).float().sum().backward()

        variants = {
            "causal": step(lambda q, k, v: kernel(q, k, v)),
            "mask": step(lambda q, k, v: kernel(q, k, v, document_ids=ids)),
            "per_document": step(lambda q, k, v: _per_document(q, k, v, ids)),
        }
        if flex is not None:
            variants["flex"] = step(flex)
        ms = _median_ms(variants, rounds)
        base = ms["causal"]
        line = ", ".join(f"{n} {t:.2f} ms ({t / base:.2f}×)" for n, t in ms.items())
        print(f"attention fwd+bwd {tuple(q.shape)} {str(dtype).removeprefix('torch.')}: {line}")


def training_step(rounds: int) -> None:
    spec = {
        "model": {
            "vocab_size": 512,
            "d_model": 128,
            "n_layers": 4,
            "n_heads": 4,
            "max_seq_len": L,
            "attention": {"name": "sdpa"},
            "position": {"name": "rope"},
        }
    }
    model = build_model(load_spec_dict(spec))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 512, (B, L), generator=torch.Generator().manual_seed(0))
    ids = _documents(B, L)

    def step(**kw):
        def run():
            opt.zero_grad(set_to_none=True)
            model(idx, idx, **kw).loss.backward()
            opt.step()

        return run

    ms = _median_ms({"causal": step(), "documents": step(document_ids=ids)}, rounds)
    print(
        f"training step (4 layers, d_model 128, batch {B}×{L}, fp32): causal "
        f"{ms['causal']:.1f} ms, documents {ms['documents']:.1f} ms "
        f"({ms['documents'] / ms['causal']:.2f}×)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    attention(args.rounds)
    training_step(max(5, args.rounds // 3))


if __name__ == "__main__":
    main()
