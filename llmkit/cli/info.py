"""``llmkit info``: the architecture layer by layer, parameters, FLOPs and memory.

The model is built on the ``meta`` device, so even a 7B spec is described instantly without
allocating memory. The argument is a spec file or, when no such file exists, a preset's name
(``llmkit info mistral-7b``). The per-layer table has one column per per-layer kind in the registry,
so a kind a plugin declares appears without edits here. The FLOPs and training-memory
lines name the batch and context they assume: ``--batch-size`` (8) and ``--seq-len``, by
default the spec's ``data.block_size``, else ``max_seq_len`` up to 2048.
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmkit.cli.common import (
    add_set,
    at_least,
    console,
    human,
    human_bytes,
    load,
    ref,
    registry,
    table,
)
from llmkit.errors import LlmkitError

#: The context ``llmkit info`` assumes for a model without ``data.block_size`` whose
#: ``max_seq_len`` is longer (a preset's 131,072 would estimate terabytes per step).
PRACTICAL_CONTEXT = 2048


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "info",
        run_info,
        help="per-layer architecture, parameters, FLOPs and memory",
        configure=configure_info,
    )


def configure_info(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "spec", help="a spec file, a run directory, or a preset's name (gpt2, llama-3.2-1b)"
    )
    add_set(p)
    p.add_argument(
        "--batch-size",
        type=at_least(1),
        default=8,
        help="sequences per step for the memory estimate (default: 8)",
    )
    p.add_argument(
        "--seq-len",
        type=at_least(1),
        default=None,
        help="context (tokens per sequence) for the FLOPs and memory estimates (default: the "
        f"spec's data.block_size, else max_seq_len up to {PRACTICAL_CONTEXT})",
    )
    p.add_argument("--json", action="store_true", help="also print the numbers as JSON")


def layer_table(rs: Any, slots: list[str]) -> tuple[list[str], list[tuple[str, ...]]]:
    """The per-layer table: its component columns (the ``slots`` some layer fills, so an
    optional kind nobody chose adds no column) and its rows, ``(layers, *components)``, where
    consecutive identical layers share one row labelled ``"start-end"`` and a slot a layer
    leaves empty shows ``-``."""
    cells = [
        [ref(res) if (res := plan.get(s)) is not None else "-" for s in slots] for plan in rs.layers
    ]
    keep = [i for i in range(len(slots)) if any(row[i] != "-" for row in cells)]
    rows = [tuple(row[i] for i in keep) for row in cells]
    out = []
    start = 0
    for j in range(1, len(rows) + 1):
        if j == len(rows) or rows[j] != rows[start]:
            label = str(start) if j - 1 == start else f"{start}-{j - 1}"
            out.append((label, *rows[start]))
            start = j
    return [slots[i] for i in keep], out


def estimate_context(
    seq_len: int | None, block_size: int | None, max_seq_len: int
) -> tuple[int, str]:
    """The context the FLOPs and memory estimates assume, and why: ``--seq-len``, else the
    spec's ``data.block_size`` (what training uses), else ``max_seq_len`` capped at
    :data:`PRACTICAL_CONTEXT`."""
    if seq_len is not None:
        return seq_len, "--seq-len"
    if block_size is not None:
        return block_size, "data.block_size"
    if max_seq_len <= PRACTICAL_CONTEXT:
        return max_seq_len, "max_seq_len"
    return PRACTICAL_CONTEXT, f"max_seq_len {max_seq_len:,} capped at {PRACTICAL_CONTEXT:,}"


def spec_source(arg: str) -> str:
    """The spec file ``arg`` names: the file itself when it exists, a run directory's
    spec.yaml, else the preset of that name. A name that is neither is a one-line error
    listing the presets; a path (with a directory or a spec file's suffix) is left to the
    loader's "spec file not found"."""
    path = Path(arg)
    if path.is_file():
        return arg
    if (path / "spec.yaml").is_file():  # a run directory (a trained or an imported run)
        return str(path / "spec.yaml")
    from llmkit.spec.files import presets

    known = presets()
    if arg in known:
        return str(known[arg])
    if len(path.parts) > 1 or path.suffix.lower() in (".toml", ".yaml", ".yml"):
        return arg
    names = sorted(known)
    close = difflib.get_close_matches(arg, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise LlmkitError(
        f"no spec file or preset named {arg!r}{hint}; presets: {', '.join(names) or 'none'}"
    )


def run_info(args: argparse.Namespace) -> int:
    from llmkit.model import build_on_meta

    rs = load(spec_source(args.spec), args.set)
    model = build_on_meta(rs)
    kinds = list(registry().kinds.values())
    m = rs.model
    con = console()
    con.print(f"[bold]{rs.spec.name or args.spec}[/]")
    con.print(
        f"d_model={m.d_model} n_layers={m.n_layers} n_heads={m.n_heads} "
        f"n_kv_heads={m.kv_heads} head_dim={m.dim_head} vocab={m.vocab_size} "
        f"max_seq_len={m.max_seq_len} tied={m.tie_embeddings}"
    )
    con.print(
        f"position: {ref(rs.position)}   final norm: {ref(rs.norm) if m.final_norm else 'none'}",
        markup=False,
    )
    columns, rows = layer_table(rs, [k.slot for k in kinds if k.per_layer and k.slot])
    layers = table("layers", *columns)
    for row in rows:
        layers.add_row(*row)
    con.print(layers)
    seq, why = estimate_context(args.seq_len, rs.spec.data.block_size, m.max_seq_len)
    batch = args.batch_size
    total, non_emb, active = (
        model.num_params(),
        model.num_params(exclude_embeddings=True),
        model.active_params(),
    )
    flops = model.flops_per_token(seq)
    mem = model.training_memory(batch, seq)
    kv = model.kv_cache_bytes_per_token()
    con.print(f"parameters:          {total:,} ({human(total)})")
    con.print(f"  non-embedding:     {non_emb:,}")
    if active != total:
        con.print(f"  active per token:  {active:,}")
    con.print(
        f"FLOPs/token @ T={seq}: forward {human(flops['forward'])}, "
        f"training {human(flops['train'])}"
    )
    con.print(
        f"KV cache:            {human_bytes(kv)}/token (fp32), {human_bytes(kv // 2)}/token (bf16)"
    )
    con.print(
        f"training step memory @ batch {batch} × context {seq:,} (context: {why}; choose "
        f"with --batch-size, --seq-len): {human_bytes(mem['total'])} = weights "
        f"{human_bytes(mem['weights'])} + grads {human_bytes(mem['gradients'])} + optimizer "
        f"{human_bytes(mem['optimizer'])} + activations {human_bytes(mem['activations'])} "
        "(estimate: fp32 weights, AdamW, bf16 activations)",
        markup=False,
    )
    chosen = [  # every kind chosen once per spec (optimizer, schedule, a plugin's loss...)
        f"{k.name}: {ref(res)}"
        for k in kinds
        if k.section and not k.per_layer and (res := rs.components.get(k.section)) is not None
    ]
    if chosen:
        con.print("   ".join(chosen), markup=False)
    if args.json:
        con.print_json(
            json.dumps(
                {
                    "params": total,
                    "non_embedding_params": non_emb,
                    "active_params": active,
                    "flops_per_token": flops,
                    "training_memory": mem,
                    "batch_size": batch,
                    "seq_len": seq,
                    "kv_cache_bytes_per_token": kv,
                }
            )
        )
    return 0
