"""The ``llmkit`` command line.

Listing and help import neither torch nor triton nor datasets; commands that build models
import them on demand. A user error prints one line and exits 2 (``--debug`` shows the
traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from llmkit.errors import LlmkitError

EXIT_USER_ERROR = 2


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def _table(*columns: str, title: str | None = None) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=None, pad_edge=False)
    for col in columns:
        table.add_column(col, overflow="fold")
    return table


def _registry() -> Any:
    from llmkit.registry import get_registry

    return get_registry()


def _warn_failures(reg: Any) -> None:
    for info in reg.failures():
        _console(stderr=True).print(
            f"[yellow]warning:[/] plugin {info.name!r} ({info.distribution}) failed: {info.error}",
            markup=True,
        )


# -- commands -----------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    reg = _registry()
    _warn_failures(reg)
    kind, pattern = args.kind, args.pattern
    if (
        kind is not None
        and kind not in reg.kinds
        and pattern is None
        and any(ch in kind for ch in "*?[")
    ):
        kind, pattern = None, kind
    if kind is not None and kind not in reg.kinds:
        reg.get(kind, "")  # raises: unknown kind, with a suggestion
    rows = reg.list(kind, pattern)
    table = _table("kind", "name", "provider", "summary")
    for c in rows:
        table.add_row(c.kind, c.name, c.provider, c.summary)
    for key, conflict in sorted(reg.conflicts.items()):
        if conflict.winner is None and (kind is None or key.startswith(f"{kind}.")):
            table.add_row(*key.split(".", 1), " & ".join(conflict.providers), "[red]CONFLICT[/]")
    _console().print(table)
    if not rows:
        return 1
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    reg = _registry()
    rec = reg.get(args.kind, args.name)
    model = rec.options_model()
    con = _console()
    con.print(f"[bold]{rec.kind} {rec.name}[/]: {rec.summary}")
    con.print(f"provider: {rec.provider} {rec.version}")
    con.print(f"target:   {rec.target_path}")
    doc = (getattr(rec.load(), "__doc__", None) or "").strip()
    if doc:
        con.print(doc, markup=False)
    caps = ", ".join(f"{k}={v}" for k, v in rec.capabilities.items()) or "none declared"
    con.print(f"capabilities: {caps}", markup=False)
    fields = model.model_fields
    if not fields:
        con.print("options: none")
        return 0
    table = _table("option", "type", "default", "description", title="options")
    for name, f in fields.items():
        default = (
            "(required)" if f.is_required() else repr(f.get_default(call_default_factory=True))
        )
        table.add_row(name, _type_name(f.annotation), default, f.description or "")
    con.print(table)
    return 0


def _type_name(ann: Any) -> str:
    text = getattr(ann, "__name__", None) if isinstance(ann, type) else None
    return text or str(ann).replace("typing.", "")


def cmd_plugins(args: argparse.Namespace) -> int:
    reg = _registry()
    table = _table("plugin", "distribution", "version", "registered", "status")
    for info in sorted(reg.plugins.values(), key=lambda p: p.name):
        status = f"[red]failed: {info.error}[/]" if info.error else "ok"
        table.add_row(info.name, info.distribution, info.version, str(len(info.registered)), status)
    con = _console()
    con.print(table)
    if args.verbose:
        for info in sorted(reg.plugins.values(), key=lambda p: p.name):
            if info.registered:
                con.print(f"{info.name}: {', '.join(info.registered)}", markup=False)
    for key, conflict in sorted(reg.conflicts.items()):
        if conflict.winner:
            losers = [p for p in conflict.providers if p != conflict.winner]
            con.print(f"{key}: {conflict.winner} wins over {', '.join(losers)}", markup=False)
        else:
            con.print(f"[red]{key}: conflict between {' and '.join(conflict.providers)}[/]")
    return 1 if reg.failures() else 0


def _load(path: str, sets: list[str] | None) -> Any:
    from llmkit.spec import load_spec

    return load_spec(path, sets or [])


def cmd_validate(args: argparse.Namespace) -> int:
    from llmkit.errors import SpecError

    failed = 0
    con = _console()
    for path in args.specs:
        try:
            rs = _load(path, args.set)
        except SpecError as exc:
            failed += 1
            _console(stderr=True).print(f"[red]✗[/] {exc}", markup=True, highlight=False)
            continue
        except LlmkitError as exc:
            failed += 1
            _console(stderr=True).print(f"[red]✗[/] {exc}", markup=True)
            continue
        con.print(f"[green]✓[/] {path}: {len(rs.layers)} layers, valid")
        if args.resolved:
            con.print_json(json.dumps(rs.to_dict()))
    return EXIT_USER_ERROR if failed else 0


def cmd_schema(args: argparse.Namespace) -> int:
    from llmkit.schema import spec_schema

    text = json.dumps(spec_schema(_registry()), indent=2)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
        _console(stderr=True).print(f"wrote {args.output}")
    else:
        sys.stdout.write(text + "\n")
    return 0


def _human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{suffix}{unit}"
        n /= 1000
    return f"{n:.3g}E{unit}"


def _bytes(n: float) -> str:
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {suffix}"
        n /= 1024
    return f"{n:.1f} PiB"


def cmd_info(args: argparse.Namespace) -> int:
    rs = _load(args.spec, args.set)
    from llmkit.model import build_model

    with _meta_device():
        model = build_model(rs)
    m = rs.model
    con = _console()
    con.print(f"[bold]{rs.spec.name or args.spec}[/]")
    con.print(
        f"d_model={m.d_model} n_layers={m.n_layers} n_heads={m.n_heads} "
        f"n_kv_heads={m.kv_heads} head_dim={m.dim_head} vocab={m.vocab_size} "
        f"max_seq_len={m.max_seq_len} norm={m.norm_placement} tied={m.tie_embeddings}"
    )
    con.print(
        f"position: {_ref(rs.position)}   final norm: {_ref(rs.norm) if m.final_norm else 'none'}",
        markup=False,
    )
    table = _table("layer", "attention", "ffn", "norm", "position")
    for j, plan in enumerate(rs.layers):
        table.add_row(
            str(j), *(_ref(getattr(plan, s)) for s in ("attention", "ffn", "norm", "position"))
        )
    con.print(table)
    seq = args.seq_len or m.max_seq_len
    batch = args.batch_size
    total, non_emb, active = (
        model.num_params(),
        model.num_params(exclude_embeddings=True),
        model.active_params(),
    )
    flops = model.flops_per_token(seq)
    mem = model.training_memory(batch, seq)
    con.print(f"parameters:          {total:,} ({_human(total)})")
    con.print(f"  non-embedding:     {non_emb:,}")
    if active != total:
        con.print(f"  active per token:  {active:,}")
    con.print(
        f"FLOPs/token @ T={seq}: forward {_human(flops['forward'])}, "
        f"training {_human(flops['train'])}"
    )
    con.print(
        f"KV cache:            {_bytes(model.kv_cache_bytes_per_token())}/token (fp32), "
        f"{_bytes(model.kv_cache_bytes_per_token() // 2)}/token (bf16)"
    )
    con.print(
        f"training step memory @ batch {batch} × {seq} (fp32 weights, AdamW, bf16 "
        f"activations, estimate): {_bytes(mem['total'])} = weights "
        f"{_bytes(mem['weights'])} + grads {_bytes(mem['gradients'])} + optimizer "
        f"{_bytes(mem['optimizer'])} + activations {_bytes(mem['activations'])}"
    )
    con.print(f"optimizer: {_ref(rs.optimizer)}   schedule: {_ref(rs.schedule)}", markup=False)
    if args.json:
        con.print_json(
            json.dumps(
                {
                    "params": total,
                    "non_embedding_params": non_emb,
                    "active_params": active,
                    "flops_per_token": flops,
                    "training_memory": mem,
                    "kv_cache_bytes_per_token": model.kv_cache_bytes_per_token(),
                }
            )
        )
    return 0


def _meta_device() -> Any:
    import torch

    return torch.device("meta")


def _ref(res: Any) -> str:
    opts = res.options.model_dump(exclude_defaults=True)
    inner = ", ".join(f"{k}={v}" for k, v in opts.items())
    return f"{res.name}({inner})" if inner else res.name


def cmd_train(args: argparse.Namespace) -> int:
    from llmkit.train import train

    sets = list(args.set or [])
    if args.max_steps is not None:
        sets.append(f"train.max_steps={args.max_steps}")
    if args.resume:
        if args.spec is not None and args.out is None:
            args.out = args.spec  # `llmkit train --resume RUN_DIR`
        elif args.spec is not None:
            raise LlmkitError("--resume takes a run directory, not a spec file")
        result = train(
            run_dir=args.out,
            overrides=sets,
            resume=True,
            max_time=args.max_time,
            progress=args.progress,
        )
    else:
        result = train(
            args.spec,
            run_dir=args.out,
            overrides=sets,
            max_time=args.max_time,
            progress=args.progress,
        )
    con = _console()
    val = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a"
    con.print(
        f"done: {result.step} steps, {result.tokens:,} tokens in {result.seconds:.1f}s "
        f"({result.stopped}); val loss {val}; run: {result.run_dir}",
        markup=False,
    )
    if not args.no_sample:
        _print_sample(result.run_dir)
    return 0


def _print_sample(run_dir: Any) -> None:
    from llmkit.generate import Sampling
    from llmkit.run import load_run

    run = load_run(run_dir)
    t = run.spec.spec.train
    if t.sample_tokens <= 0:
        return
    text = _complete(
        run,
        t.sample_prompt,
        Sampling(max_new_tokens=t.sample_tokens, temperature=0.8, top_k=50, seed=t.seed),
    )
    con = _console()
    con.rule("sample")
    con.print(t.sample_prompt + text, markup=False, highlight=False)
    con.rule()


def _complete(run: Any, prompt: str, sampling: Any) -> str:
    import torch

    from llmkit.generate import generate_ids

    tok = run.tokenizer
    ids = tok.encode(prompt) if prompt else []
    if not ids:
        ids = [tok.eos_id if tok.eos_id is not None else 0]
    ids = ids[-run.model.config.max_seq_len :]
    if sampling.eos_id is None and prompt:
        sampling.eos_id = tok.eos_id
    new = generate_ids(run.model, torch.tensor([ids]), sampling)
    return tok.decode(new[0].tolist())


def cmd_generate(args: argparse.Namespace) -> int:
    from llmkit.generate import Sampling
    from llmkit.run import load_run

    run = load_run(args.run, which=args.weights)
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    text = _complete(run, args.prompt, sampling)
    sys.stdout.write(args.prompt + text + "\n")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from llmkit import hardware
    from llmkit.evaluate import evaluate_batches, full_text_batches
    from llmkit.run import load_run

    run = load_run(args.run, which=args.weights)
    device = hardware.choose_device(args.device)
    run.model.to(device)
    block = run.spec.spec.data.block_size or run.spec.model.max_seq_len
    if args.data:
        from pathlib import Path

        path = Path(args.data)
        if not path.is_file():
            raise LlmkitError(f"--data: file not found: {path}")
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text:
            raise LlmkitError(f"--data: {path} is empty")
        tokens = torch.tensor(run.tokenizer.encode(text), dtype=torch.long)
        if tokens.numel() < 2:
            raise LlmkitError(f"--data: {path} has fewer than 2 tokens")
        res = evaluate_batches(run.model, full_text_batches(tokens, block, args.batch_size), device)
        res.text_bytes = len(text.encode("utf-8"))
        source = str(path)
    else:
        from llmkit.data import prepare_data

        data = prepare_data(run.spec, run.run_dir, run.tokenizer, log=lambda _m: None)
        tokens = torch.from_numpy(data.validation.array.astype("int64"))
        res = evaluate_batches(run.model, full_text_batches(tokens, block, args.batch_size), device)
        res.text_bytes = data.validation.n_bytes_text
        source = "validation split"
    con = _console()
    con.print(f"{run.weights} on {source}: {res.tokens:,} tokens", markup=False)
    con.print(f"loss {res.loss:.4f} nats/token, perplexity {res.ppl:.3f}")
    if res.bits_per_byte is not None:
        con.print(f"{res.nats_per_byte:.4f} nats/byte, {res.bits_per_byte:.4f} bits/byte")
    if args.json:
        con.print_json(json.dumps(res.as_dict()))
    return 0


# -- parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmkit",
        description="Build language models from interchangeable components.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> Any:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=fn)
        return p

    p = add("list", cmd_list, "list registered components (wildcards allowed)")
    p.add_argument("kind", nargs="?", help="attention, ffn, norm, position, optimizer, ...")
    p.add_argument("pattern", nargs="?", help="name pattern, e.g. 'sw*'")

    p = add("show", cmd_show, "show a component: summary, options, provider, capabilities")
    p.add_argument("kind")
    p.add_argument("name")

    p = add("plugins", cmd_plugins, "list plugins, what they registered, and failures")
    p.add_argument("-v", "--verbose", action="store_true", help="list every component")

    p = add("validate", cmd_validate, "validate spec files")
    p.add_argument("specs", nargs="+", metavar="SPEC")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override")
    p.add_argument("--resolved", action="store_true", help="print the resolved spec as JSON")

    p = add("schema", cmd_schema, "write the JSON Schema of spec files")
    p.add_argument("-o", "--output", help="file to write (default: stdout)")

    p = add("info", cmd_info, "per-layer architecture, parameters, FLOPs and memory")
    p.add_argument("spec")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override")
    p.add_argument("--batch-size", type=int, default=8, help="batch for the memory estimate")
    p.add_argument("--seq-len", type=int, default=None, help="default: max_seq_len")
    p.add_argument("--json", action="store_true", help="also print the numbers as JSON")

    p = add("train", cmd_train, "train a model from a spec, or resume a run")
    p.add_argument("spec", nargs="?", help="spec file (or the run directory with --resume)")
    p.add_argument("--out", help="run directory (default runs/<name>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out / RUN")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override")
    p.add_argument("--max-steps", type=int, help="optimizer steps (sets train.max_steps)")
    p.add_argument("--max-time", type=float, help="stop after this many seconds")
    p.add_argument("--no-sample", action="store_true", help="skip the sample at the end")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when on a terminal)",
    )

    p = add("eval", cmd_eval, "loss and perplexity of a run or checkpoint")
    p.add_argument("run", help="run directory or checkpoint directory")
    p.add_argument("--data", help="a text file (default: the run's validation split)")
    p.add_argument("--weights", choices=["final", "best", "latest"], default="final")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true")

    p = add("generate", cmd_generate, "generate text from a trained run")
    p.add_argument("run", help="run directory or checkpoint directory")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--weights", choices=["final", "best", "latest"], default="final")
    return parser


def _version() -> str:
    from llmkit import __version__

    return f"llmkit {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except LlmkitError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
