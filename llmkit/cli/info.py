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
        help="sequences per step for the memory estimate (default: 8); with --parallel, per "
        "data-parallel rank",
    )
    p.add_argument(
        "--seq-len",
        type=at_least(1),
        default=None,
        help="context (tokens per sequence) for the FLOPs and memory estimates (default: the "
        f"spec's data.block_size, else max_seq_len up to {PRACTICAL_CONTEXT})",
    )
    p.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    p.add_argument(
        "--parallel",
        metavar="LAYOUT",
        default=None,
        help="plan this layout on paper: per-GPU memory and communication per step, e.g. "
        "dp=32,tp=8,pp=4 (dp/fsdp = dp_shard, ddp = dp_replicate, tp, pp, cp); --batch-size "
        "is then per data-parallel rank",
    )
    p.add_argument(
        "--gpus",
        metavar="GPU",
        default=None,
        help="the GPU of the --parallel plan (H100, H200, A100): whether it fits, a step time",
    )
    p.add_argument(
        "--schedule",
        choices=["1f1b", "gpipe", "interleaved_1f1b"],
        default="1f1b",
        help="the pipeline schedule of the --parallel plan (pp > 1; default 1f1b)",
    )
    p.add_argument(
        "--microbatches",
        type=at_least(1),
        default=None,
        help="pipeline micro-batches per step of the --parallel plan (default: pp; "
        "interleaved_1f1b: 2·pp); they divide --batch-size",
    )


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

    layout = parallel_layout(args)
    gpu = None
    if args.gpus is not None:
        from llmkit.parallel.planning import gpu_spec

        gpu = gpu_spec(args.gpus)
    rs = load(spec_source(args.spec), args.set)
    model = build_on_meta(rs)
    seq, why = estimate_context(args.seq_len, rs.spec.data.block_size, rs.model.max_seq_len)
    batch = args.batch_size
    plan = None
    if layout is not None:  # before any output: a layout it cannot split is one line
        plan = make_plan(rs, model, layout, batch=batch, seq=seq, gpu=gpu)
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
    if plan is not None:
        print_plan(con, rs, plan)
    if args.json:
        numbers = {
            "params": total,
            "non_embedding_params": non_emb,
            "active_params": active,
            "flops_per_token": flops,
            "training_memory": mem,
            "batch_size": batch,
            "seq_len": seq,
            "kv_cache_bytes_per_token": kv,
        }
        if plan is not None:
            numbers["parallel_plan"] = plan.as_dict()
        con.print_json(json.dumps(numbers))
    return 0


def parallel_layout(args: argparse.Namespace) -> Any:
    """The :class:`~llmkit.parallel.layout.Layout` ``--parallel`` names (None without it);
    bad text is one line."""
    if args.parallel is None:
        for flag, value in (("--gpus", args.gpus), ("--microbatches", args.microbatches)):
            if value is not None:
                raise LlmkitError(f"{flag} describes a --parallel plan; give --parallel too")
        return None
    import dataclasses

    from llmkit.parallel.layout import parse_layout

    layout = parse_layout(args.parallel, schedule=args.schedule)
    if args.microbatches is not None and layout.pp > 1:
        layout = dataclasses.replace(layout, microbatches=args.microbatches)
    return layout


def _collectives(dim: str, layout: Any, checkpointing: bool) -> str:
    """What mesh dimension ``dim`` sends, for the communication table."""
    recompute = " (+4 recomputing)" if checkpointing else ""
    return {
        "fsdp": "all-gather params "
        + ("(forward, backward)" if layout.pp == 1 else "(once: kept through the pipeline)")
        + ", reduce-scatter fp32 grads",
        "ddp": "all-reduce fp32 grads",
        "tp": f"all-gather/reduce-scatter activations: 4 per layer forward{recompute}, 4 backward",
        "cp": "ring: K/V shards forward and backward, fp32 dK/dV back",
        "pp": "activations forward, their gradients backward",
    }[dim]


def make_plan(rs: Any, model: Any, layout: Any, *, batch: int, seq: int, gpu: Any) -> Any:
    """The :class:`~llmkit.parallel.planning.ParallelPlan` of ``layout`` for this spec, in
    its precision (``train.precision``: fp32, else bf16) and with its activation
    checkpointing. A layout the plan cannot split is one line (an error)."""
    from llmkit.parallel.planning import plan_memory

    t = rs.spec.train
    return plan_memory(
        model,
        layout,
        batch_size=batch,
        seq_len=seq,
        precision="fp32" if t.precision == "fp32" else "bf16",
        activation_checkpointing=bool(t.activation_checkpointing),
        gpu=gpu,
    )


def print_plan(con: Any, rs: Any, plan: Any) -> None:
    """Print a ``--parallel`` plan: ``layout_problems`` lines as warnings (stderr), per-GPU
    memory, communication per step by dimension, and with a GPU whether it fits and a step
    time."""
    from rich.markup import escape

    from llmkit.parallel.layout import layout_problems
    from llmkit.parallel.planning import MFU_ASSUMPTION

    layout, gpu, batch, seq = plan.layout, plan.gpu, plan.batch_size, plan.seq_len
    precision, checkpointing = plan.precision, plan.activation_checkpointing
    t = rs.spec.train
    spec = rs.spec.model_copy(  # the problems of the plan's batch and context
        update={
            "train": t.model_copy(update={"batch_size": batch}),
            "data": rs.spec.data.model_copy(update={"block_size": seq}),
        }
    )
    err = console(stderr=True)
    for line in layout_problems(spec, layout, [p.attention for p in rs.layers]):
        err.print(f"[yellow]warning:[/] {escape(line)}", markup=True)
    world = layout.world_size
    micro = f"micro-batches of {plan.microbatch_size}" if layout.pp > 1 else "one micro-batch"
    con.print(
        f"parallel plan: {layout.describe()} = {world:,} GPUs"
        + (f" ({gpu.name})" if gpu is not None else "")
        + f"; {batch} × {seq:,} tokens per data-parallel rank per step ({micro}); "
        f"{'bf16 compute, fp32 master weights and grads' if precision == 'bf16' else 'fp32'}, "
        f"AdamW; activation checkpointing {'on' if checkpointing else 'off'} "
        "(train.precision, train.activation_checkpointing)",
        markup=False,
    )
    cols = ["params", "grads", "optimizer", "unsharded", "activations", "total"]
    if gpu is not None:
        cols.append(f"fits {gpu.name} ({human_bytes(gpu.memory_bytes)})")
    where = f" (pipeline rank {plan.memory_rank.rank} of {layout.pp})" if layout.pp > 1 else ""
    mem = table(*cols, title=f"memory per GPU{where}")
    row = [
        human_bytes(v)
        for v in (
            plan.param_bytes,
            plan.grad_bytes,
            plan.optimizer_bytes,
            plan.unsharded_bytes,
            plan.activation_bytes,
            plan.total_bytes,
        )
    ]
    if gpu is not None:
        row.append("yes" if plan.fits else "NO")
    mem.add_row(*row)
    con.print(mem)
    where = f" (pipeline rank {plan.comm_rank.rank})" if layout.pp > 1 else ""
    comm = table("dimension", "degree", "bytes", "what", title=f"sent per GPU per step{where}")
    degrees = {
        "fsdp": layout.dp_shard * layout.cp,
        "ddp": layout.dp_replicate,
        "tp": layout.tp,
        "cp": layout.cp,
        "pp": layout.pp,
    }
    for dim, sent in plan.comm.items():
        if degrees[dim] > 1:
            what = _collectives(dim, layout, checkpointing)
            comm.add_row(dim, str(degrees[dim]), human_bytes(sent), what)
        else:
            comm.add_row(dim, "1", "-", "-")
    comm.add_row("total", "", human_bytes(plan.comm_total), "")
    con.print(comm)
    if plan.step_time is not None:
        con.print(
            f"step time ≥ {plan.step_time:.3g} s: {human(plan.flops_per_step)} FLOPs "
            f"at {MFU_ASSUMPTION:.0%} MFU of {gpu.peak_flops / 1e12:,.0f} TFLOP/s per GPU "
            f"({plan.tokens_per_second_per_gpu:,.0f} tokens/s/GPU)"
        )
