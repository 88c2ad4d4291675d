"""The ``llmkit`` command line.

Listing and help import neither torch nor triton nor datasets; commands that build models
import them on demand. A user error prints one line and exits 2 (``--debug`` shows the
traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
    from rich.markup import escape

    for info in reg.failures():
        _console(stderr=True).print(
            f"[yellow]warning:[/] plugin {info.name!r} ({info.distribution}) failed: "
            f"{escape(info.error)}",
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
    model = rec.options_model()  # a module that fails to import: a one-line RegistryError
    factory = rec.load()
    con = _console()
    con.print(f"[bold]{rec.kind} {rec.name}[/]: {rec.summary}")
    con.print(f"provider: {rec.provider} {rec.version}")
    con.print(f"target:   {rec.target_path}")
    doc = (getattr(factory, "__doc__", None) or "").strip()
    if doc:
        con.print(doc, markup=False)
    caps = ", ".join(f"{k}={v}" for k, v in rec.capabilities.items()) or "none declared"
    con.print(f"capabilities: {caps}", markup=False)
    runtime = getattr(factory, "runtime_backend", None)
    if callable(runtime):
        con.print(f"runtime: {runtime()}", markup=False)
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


def _installed_entry_points() -> dict[str, str]:
    """Installed ``llmkit`` entry points: name → distribution (no plugin is imported)."""
    import importlib.metadata as md

    out: dict[str, str] = {}
    for ep in md.entry_points(group="llmkit"):
        dist = getattr(ep, "dist", None)
        out.setdefault(ep.name, dist.metadata["Name"] if dist is not None else "?")
    return out


def _provides(reg: Any, info: Any) -> str:
    """What a plugin registered: new kinds, then a count per kind."""
    by_kind: dict[str, list[str]] = {}
    for key in info.registered:
        kind, _, name = key.partition(".")
        by_kind.setdefault(kind, []).append(name)
    parts = []
    new_kinds = sorted(
        k.name
        for k in reg.kinds.values()
        if k.provider == info.distribution and info.name != "builtin"
    )
    if new_kinds:
        parts.append(f"new kind {', '.join(new_kinds)}")
    for kind in sorted(by_kind):
        names = by_kind[kind]
        parts.append(f"{kind} {len(names)}")
    return "; ".join(parts) or "-"


def _plugins_report(reg: Any) -> dict[str, Any]:
    """Everything ``llmkit plugins`` shows, as data (also its ``--json`` output)."""
    import os

    from llmkit.registry import allowed_plugins

    lost: dict[str, list[str]] = {}
    for rec in reg.overridden:
        lost.setdefault(rec.provider, []).append(rec.key)
    plugins = []
    for info in sorted(reg.plugins.values(), key=lambda p: (p.name != "builtin", p.name)):
        plugins.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "status": "failed" if info.error else "ok",
                "error": info.error,
                "registered": list(info.registered),
                "kinds": sorted(
                    k.name
                    for k in reg.kinds.values()
                    if k.provider == info.distribution and info.name != "builtin"
                ),
                "overridden": sorted(set(lost.get(info.distribution, []))),
            }
        )
    allowed = allowed_plugins()
    skipped = [
        {"name": name, "distribution": dist}
        for name, dist in sorted(_installed_entry_points().items())
        if name not in reg.plugins
    ]
    conflicts = [
        {"key": c.key, "providers": list(c.providers), "winner": c.winner}
        for c in sorted(reg.conflicts.values(), key=lambda c: c.key)
    ]
    return {
        "plugins": plugins,
        "not_loaded": skipped,
        "conflicts": conflicts,
        "allow_list": allowed,
        "registry_file": os.environ.get("LLMKIT_REGISTRY") or None,
        "strict": bool(getattr(reg, "strict", False)),
    }


def cmd_plugins(args: argparse.Namespace) -> int:
    reg = _registry()
    report = _plugins_report(reg)
    unresolved = [c for c in report["conflicts"] if c["winner"] is None]
    code = 1 if reg.failures() or unresolved else 0
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
        return code
    con = _console()
    table = _table("plugin", "distribution", "version", "provides", "status")
    for p in report["plugins"]:
        info = reg.plugins[p["name"]]
        if p["error"]:
            status = "[red]FAILED[/] (below)"
        elif p["overridden"]:
            status = f"ok, [yellow]{len(p['overridden'])} not used[/] (below)"
        else:
            status = "ok"
        provides = _provides(reg, info) if not p["error"] else "nothing"
        table.add_row(p["name"], p["distribution"], p["version"], provides, status)
    for s in report["not_loaded"]:
        table.add_row(s["name"], s["distribution"], "", "", "[dim]off[/]")
    con.print(table)
    if report["not_loaded"]:
        allow = ",".join(report["allow_list"] or [])
        con.print(f"off: installed but not loaded, as LLMKIT_PLUGINS={allow!r}", markup=False)
    if args.verbose:  # one line per plugin: every component it registered, and which lost
        for info in sorted(reg.plugins.values(), key=lambda p: p.name):
            if not info.registered:
                continue
            names = []
            for key in info.registered:
                conflict = reg.conflicts.get(key)
                if conflict is None or conflict.winner == info.distribution:
                    names.append(key)
                elif conflict.winner is None:
                    names.append(f"{key} (unusable: conflict)")
                else:
                    names.append(f"{key} (overridden by {conflict.winner})")
            con.print(f"{info.name}: {', '.join(names)}", markup=False)
    failed = [p for p in report["plugins"] if p["error"]]
    if failed:
        con.print(
            "\n[bold red]failed to load[/] (their components are unavailable; other "
            "plugins are unaffected):"
        )
        for p in failed:
            con.print(
                f"  {p['name']} ({p['distribution']} {p['version']}".rstrip() + f"): {p['error']}",
                markup=False,
            )
        con.print(
            "  fix: reinstall or upgrade it, leave it out of LLMKIT_PLUGINS, or uninstall it; "
            "the traceback: LLMKIT_STRICT_PLUGINS=1 llmkit --debug plugins; "
            "see docs/plugins/troubleshooting.md",
            markup=False,
        )
    settled = [c for c in report["conflicts"] if c["winner"]]
    if settled:
        source = f"$LLMKIT_REGISTRY ({report['registry_file']})" if report["registry_file"] else ""
        where = " or ".join(x for x in ("registry.toml", source) if x)
        con.print(
            f"\n[bold]overridden[/] (name clashes settled by \\[winners] in {where}):",
            markup=True,
            highlight=False,
        )
        for c in settled:
            losers = [p for p in c["providers"] if p != c["winner"]]
            con.print(f"  {c['key']}: {c['winner']} wins over {', '.join(losers)}", markup=False)
    if unresolved:
        con.print(
            "\n[bold red]conflicts[/] (these names are unusable until you choose a provider):"
        )
        for c in unresolved:
            con.print(
                f"  {c['key']}: conflict between {' and '.join(c['providers'])}; choose one "
                f'in the file $LLMKIT_REGISTRY names: [winners] "{c["key"]}" = '
                f'"{c["providers"][0]}"',
                markup=False,
            )
    return code


def cmd_plugin_new(args: argparse.Namespace) -> int:
    from llmkit.scaffold import new_plugin, plugin_names

    names = plugin_names(args.name, args.kind, args.component)
    reg = _registry()
    if names.component in reg.names(names.kind) or f"{names.kind}.{names.component}" in (
        reg.conflicts
    ):
        owner = reg.components.get(f"{names.kind}.{names.component}")
        by = f" (from {owner.provider})" if owner is not None else ""
        raise LlmkitError(
            f"{names.kind} {names.component!r} already exists{by}; choose another component "
            "name with --component"
        )
    root, names, files = new_plugin(args.name, args.kind, args.dir, args.component)
    con = _console()
    con.print(
        f"created {names.distribution} in {root}: {names.kind} {names.component!r} "
        f"({names.target}), entry point {names.entry_point!r}",
        markup=False,
    )
    for path in files:
        con.print(f"  {path.relative_to(root)}", markup=False)
    con.print(
        f"next:\n  pip install -e {root}\n  pytest {root}\n"
        f"  llmkit show {names.kind} {names.component}",
        markup=False,
    )
    return 0


def _plugin_help(args: argparse.Namespace) -> int:
    args.plugin_parser.print_help()
    return 0


def _load(path: str, sets: list[str] | None) -> Any:
    from llmkit.spec import load_spec

    return load_spec(path, sets or [])


def cmd_validate(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from llmkit.errors import SpecError

    _warn_failures(_registry())

    failed = 0
    con = _console()
    for path in args.specs:
        try:
            rs = _load(path, args.set)
        except SpecError as exc:
            failed += 1
            _console(stderr=True).print(
                f"[red]✗[/] {escape(str(exc))}", markup=True, highlight=False
            )
            continue
        except LlmkitError as exc:
            failed += 1
            _console(stderr=True).print(f"[red]✗[/] {escape(str(exc))}", markup=True)
            continue
        try:  # what only the components know (e.g. RoPE's even rotary dims): build, on meta
            _build_on_meta(rs)
        except LlmkitError as exc:
            failed += 1
            _console(stderr=True).print(
                f"[red]✗[/] {escape(str(path))}: the model does not build: {escape(str(exc))}",
                markup=True,
            )
            continue
        # With --resolved, stdout carries only the JSON (pipeable); the verdict goes to stderr.
        (_console(stderr=True) if args.resolved else con).print(
            f"[green]✓[/] {path}: {len(rs.layers)} layers, valid"
        )
        if args.resolved:
            con.print_json(json.dumps(rs.to_dict()))
    return EXIT_USER_ERROR if failed else 0


def cmd_schema(args: argparse.Namespace) -> int:
    from llmkit.spec.schema import spec_schema

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
    model = _build_on_meta(rs)
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
    table = _table("layers", "attention", "ffn", "norm", "position")
    rows = [
        tuple(_ref(getattr(plan, s)) for s in ("attention", "ffn", "norm", "position"))
        for plan in rs.layers
    ]
    start = 0
    for j in range(1, len(rows) + 1):  # consecutive identical layers share one row
        if j == len(rows) or rows[j] != rows[start]:
            label = str(start) if j - 1 == start else f"{start}-{j - 1}"
            table.add_row(label, *rows[start])
            start = j
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


def _build_on_meta(rs: Any) -> Any:
    """The spec's model with parameters on the meta device: shapes only, no memory."""
    import torch

    from llmkit.model import build_model

    with torch.device("meta"):
        return build_model(rs)


def _ref(res: Any) -> str:
    opts = res.options.model_dump(exclude_defaults=True)
    inner = ", ".join(f"{k}={v}" for k, v in opts.items())
    return f"{res.name}({inner})" if inner else res.name


def cmd_train(args: argparse.Namespace) -> int:
    from llmkit.training import train

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
    if result.rank != 0:
        return 0  # rank 0 reports for the job
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
    from llmkit.inference import Sampling
    from llmkit.runs import load_run

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
    """The continuation of ``prompt``. An empty prompt starts from the document separator
    and, unless ``sampling.eos_id`` is set, runs across documents (EOS does not stop it)."""
    import dataclasses

    from llmkit.inference import Generator

    if not prompt and sampling.eos_id is None:
        sampling = dataclasses.replace(sampling, ignore_eos=True)
    return Generator(run).generate(prompt, sampling)[0].text


def _sampling_from_args(args: argparse.Namespace) -> Any:
    from llmkit.inference import Sampling

    beams = args.num_beams > 1
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=0.0 if beams else args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in args.stop or ()),
        num_beams=args.num_beams,
        length_penalty=args.length_penalty,
        early_stopping=not args.no_early_stopping,
    )
    try:
        sampling.validate()
    except ValueError as exc:
        raise LlmkitError(str(exc)) from exc
    return sampling


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _stream_one(gen: Any, prompt: str, sampling: Any) -> Any:
    stream = gen.stream(prompt, sampling)
    for piece in stream:
        _write(piece)
    return stream.result


def _interactive(gen: Any, sampling: Any, stream: bool) -> int:
    """One prompt per line (each continued on its own) until EOF or `exit`."""
    tty = sys.stdin.isatty()
    if tty:
        sys.stderr.write("llmkit generate: one prompt per line; `exit` or Ctrl-D ends\n")
    while True:
        if tty:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            break
        prompt = line.rstrip("\r\n")
        if prompt.strip() in ("exit", "quit"):
            break
        if stream and sampling.num_beams == 1:
            _stream_one(gen, prompt, sampling)
        else:
            _write(gen.generate(prompt, sampling)[0].text)
        _write("\n")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from llmkit import hardware
    from llmkit.inference import Generator
    from llmkit.runs import load_run

    sampling = _sampling_from_args(args)
    device = hardware.choose_device(args.device)
    run = load_run(args.run, which=args.weights, device=str(device))
    try:
        gen = Generator(run, quantize=args.quantize)
    except ValueError as exc:
        raise LlmkitError(str(exc)) from exc
    if args.interactive:
        return _interactive(gen, sampling, args.stream)
    prompts = args.prompt or [""]
    if args.stream and sampling.num_beams > 1:
        raise LlmkitError("--stream needs sampling or greedy decoding (--num-beams 1)")
    if args.stream and not args.json:
        for i, prompt in enumerate(prompts):
            if i:
                _write("\n")
            _write(prompt)
            _stream_one(gen, prompt, sampling)
            _write("\n")
        return 0
    results = gen.generate(prompts, sampling)
    if args.json:
        out = [
            {
                "prompt": p,
                "text": r.text,
                "ids": r.ids,
                "finish_reason": r.finish_reason,
                "score": r.score,
            }
            for p, r in zip(prompts, results)
        ]
        _write(json.dumps(out if len(out) > 1 else out[0], ensure_ascii=False) + "\n")
        return 0
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        if i:
            _write("\n")
        _write(prompt + r.text + "\n")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from llmkit import hardware
    from llmkit.runs import load_run
    from llmkit.training.evaluate import evaluate_batches, full_text_batches

    run = load_run(args.run, which=args.weights)
    device = hardware.choose_device(args.device)
    run.model.to(device)
    block = run.spec.spec.data.block_size or run.spec.model.max_seq_len
    if args.data:
        from pathlib import Path

        path = Path(args.data)
        if not path.is_file():
            raise LlmkitError(f"--data: file not found: {path}")
        from llmkit.components.dataset import read_utf8

        text = read_utf8(path)
        if not text:
            raise LlmkitError(f"--data: {path} is empty")
        tokens = torch.tensor(run.tokenizer.encode(text), dtype=torch.long)
        if tokens.numel() < 2:
            raise LlmkitError(f"--data: {path} has fewer than 2 tokens")
        text_bytes = len(text.encode("utf-8"))
        source = str(path)
    else:
        from llmkit.data import prepare_data

        data = prepare_data(run.spec, run.run_dir, run.tokenizer, log=lambda _m: None)
        tokens = torch.from_numpy(data.validation.array.astype("int64"))
        text_bytes = data.validation.n_bytes_text
        source = "validation split"

    def evaluate(model: Any) -> Any:
        res = evaluate_batches(model, full_text_batches(tokens, block, args.batch_size), device)
        res.text_bytes = text_bytes
        return res

    res = evaluate(run.model)
    con = _console(stderr=args.json)  # with --json, stdout carries the JSON alone
    con.print(f"{run.weights} on {source}: {res.tokens:,} tokens", markup=False)
    con.print(f"loss {res.loss:.4f} nats/token, perplexity {res.ppl:.3f}")
    if res.bits_per_byte is not None:
        con.print(f"{res.nats_per_byte:.4f} nats/byte, {res.bits_per_byte:.4f} bits/byte")
    report = res.as_dict()
    if args.quantize:
        from llmkit.inference.quantize import quantize_model, weight_bytes

        try:
            qmodel = quantize_model(run.model, args.quantize)
        except ValueError as exc:
            raise LlmkitError(str(exc)) from exc
        qres = evaluate(qmodel)
        base_bytes, q_bytes = weight_bytes(run.model), weight_bytes(qmodel)
        dtype = str(next(run.model.parameters()).dtype).removeprefix("torch.")
        info = qmodel.quantization
        table = _table("weights", "bytes", "loss", "perplexity", "bits/byte")
        for name, nbytes, r in ((dtype, base_bytes, res), (args.quantize, q_bytes, qres)):
            bpb = f"{r.bits_per_byte:.4f}" if r.bits_per_byte is not None else "-"
            table.add_row(name, _bytes(nbytes), f"{r.loss:.4f}", f"{r.ppl:.3f}", bpb)
        con.print(table)
        con.print(
            f"{args.quantize} ({info.backend}, {info.linears} linear layers): weights "
            f"{base_bytes / max(q_bytes, 1):.2f}× smaller, loss {qres.loss - res.loss:+.5f} "
            f"nats/token, perplexity {100 * (qres.ppl / res.ppl - 1):+.2f}%",
            markup=False,
        )
        report["weight_bytes"] = base_bytes
        report[args.quantize] = {
            **qres.as_dict(),
            "weight_bytes": q_bytes,
            "backend": info.backend,
            "linear_layers": info.linears,
        }
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _bench_help(args: argparse.Namespace) -> int:
    args.bench_parser.print_help()
    return 0


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    from llmkit.bench.kernels import run_cli

    return run_cli(args)


def cmd_bench_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from llmkit import hardware
    from llmkit.bench.generation import bench_generate

    device = hardware.choose_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.run)
    if path.is_file():  # a spec file: random weights of that shape
        from llmkit.model import build_model

        rs = _load(args.run, args.set)
        torch.manual_seed(0)
        model = build_model(rs).to(device).eval()
        name = rs.spec.name or path.stem
    else:
        from llmkit.runs import load_run

        if args.set:
            raise LlmkitError("--set applies to a spec file, not a run directory")
        model = load_run(args.run, which=args.weights, device=str(device)).model
        name = str(path)
    params = model.num_params()
    if args.quantize:
        from llmkit.inference.quantize import quantize_model

        try:
            model = quantize_model(model, args.quantize)
        except ValueError as exc:
            raise LlmkitError(str(exc)) from exc
    from llmkit.inference import prepare_for_decoding

    prepare_for_decoding(model)
    try:
        sizes = tuple(int(b) for b in args.batch_sizes.split(",") if b.strip())
    except ValueError as exc:
        raise LlmkitError(f"--batch-sizes: expected e.g. 1,8; got {args.batch_sizes!r}") from exc
    if not sizes or min(sizes) < 1:
        raise LlmkitError(f"--batch-sizes: expected positive integers, got {args.batch_sizes!r}")
    if args.new_tokens < 2 or args.prompt_len < 1 or args.repeats < 1:
        raise LlmkitError("--new-tokens must be ≥ 2, --prompt-len and --repeats ≥ 1")
    rows = bench_generate(
        model,
        batch_sizes=sizes,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
    )
    meta = {
        "model": name,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "quantize": args.quantize,
        "params": params,
    }
    if args.json:
        _write(json.dumps({**meta, "results": [r.as_dict() for r in rows]}) + "\n")
        return 0
    con = _console()
    con.print(
        f"{name}: {meta['params']:,} parameters on {device} ({meta['threads']} threads)"
        + (f", {args.quantize}" if args.quantize else "")
        + ("" if model.supports_kv_cache else ", no KV cache (full forward per token)"),
        markup=False,
    )
    table = _table(
        "batch", "prompt", "new", "prefill tok/s", "TTFT", "decode tok/s", "peak mem", "KV cache"
    )
    con.print(f"weights {_bytes(rows[0].weight_bytes)}", markup=False)
    for r in rows:
        table.add_row(
            str(r.batch_size),
            str(r.prompt_len),
            str(r.new_tokens),
            f"{r.prefill_tokens_per_s:,.0f}",
            f"{1000 * r.ttft_s:.1f} ms",
            f"{r.decode_tokens_per_s:,.1f}",
            _bytes(r.peak_memory_bytes),
            _bytes(r.kv_cache_bytes),
        )
    con.print(table)
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

    p = add("plugins", cmd_plugins, "list plugins, what they provide, failures and overrides")
    p.add_argument("-v", "--verbose", action="store_true", help="list every component")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    from llmkit.scaffold import KINDS as SCAFFOLD_KINDS  # stdlib only: stays import-light

    plugin = add("plugin", _plugin_help, "plugin authoring: `llmkit plugin new NAME`")
    plugin.set_defaults(plugin_parser=plugin)
    actions = plugin.add_subparsers(dest="plugin_command", metavar="ACTION")
    p = actions.add_parser(
        "new",
        help="generate a plugin package that installs and passes its own tests",
        description="Generate a plugin package in DIR/NAME: pyproject.toml declaring the "
        "llmkit entry point, one component of KIND with its options model, tests running the "
        "conformance suite, and a README.",
    )
    p.set_defaults(func=cmd_plugin_new)
    p.add_argument("name", metavar="NAME", help="distribution name, e.g. llmkit-my-ffn")
    p.add_argument("--kind", choices=SCAFFOLD_KINDS, default="ffn", help="default: ffn")
    p.add_argument("--dir", default=".", help="where to create NAME/ (default: here)")
    p.add_argument(
        "--component", help="the name specs use (default: NAME without 'llmkit-', '-' → '_')"
    )

    p = add("validate", cmd_validate, "validate spec files")
    p.add_argument("specs", nargs="+", metavar="SPEC")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override")
    p.add_argument("--resolved", action="store_true", help="print the resolved spec as JSON")

    p = add("schema", cmd_schema, "write the JSON Schema of spec files")
    p.add_argument("-o", "--output", help="file to write (default: stdout)")

    p = add("info", cmd_info, "per-layer architecture, parameters, FLOPs and memory")
    p.add_argument("spec")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override")
    p.add_argument(
        "--batch-size", type=_at_least(1), default=8, help="batch for the memory estimate"
    )
    p.add_argument("--seq-len", type=_at_least(1), default=None, help="default: max_seq_len")
    p.add_argument("--json", action="store_true", help="also print the numbers as JSON")

    p = add("train", cmd_train, "train a model from a spec, or resume a run")
    p.add_argument("spec", nargs="?", help="spec file (or the run directory with --resume)")
    p.add_argument("--out", help="run directory (default runs/<name>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out / RUN")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override")
    p.add_argument("--max-steps", type=_at_least(1), help="optimizer steps (sets train.max_steps)")
    p.add_argument("--max-time", type=_seconds, help="stop after this many seconds")
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
    p.add_argument("--batch-size", type=_at_least(1), default=8)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--quantize",
        choices=["int8"],
        help="also evaluate int8 weights: prints both sizes, losses and perplexities",
    )
    p.add_argument("--json", action="store_true")

    p = add("generate", cmd_generate, "generate text from a trained run")
    p.add_argument("run", help="run directory or checkpoint directory")
    p.add_argument(
        "--prompt",
        action="append",
        help="text to continue (repeat for a batch; default: a new document)",
    )
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely")
    p.add_argument("--top-p", type=float, default=None, help="nucleus: smallest set of mass p")
    p.add_argument(
        "--min-p", type=float, default=None, help="drop tokens below min-p × the top probability"
    )
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeated tokens"
    )
    p.add_argument("--num-beams", type=int, default=1, help="> 1: beam search (deterministic)")
    p.add_argument(
        "--length-penalty", type=float, default=1.0, help="beam score = log p / length**this"
    )
    p.add_argument(
        "--no-early-stopping",
        action="store_true",
        help="beam search: go on while a running beam can still win",
    )
    p.add_argument(
        "--stop", action="append", metavar="TEXT", help="stop at this text (repeatable; \\n ok)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    p.add_argument("--seed", type=_seed, default=None)
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument(
        "--interactive", action="store_true", help="read prompts from stdin until EOF or `exit`"
    )
    p.add_argument("--quantize", choices=["int8"], help="int8 weights (smaller; CPU: faster)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, mps or auto")
    p.add_argument("--json", action="store_true", help="print text, ids and finish reasons")
    p.add_argument("--weights", choices=["final", "best", "latest"], default="final")

    bench = add(
        "bench", _bench_help, "benchmarks: `llmkit bench generate RUN`, `llmkit bench kernels`"
    )
    bench.set_defaults(bench_parser=bench)
    benches = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    p = benches.add_parser(
        "generate",
        help="generation speed: prefill and decode tokens/s, time to first token, memory",
        description="Time greedy generation on random prompts at each batch size: prompt "
        "processing and decoding tokens/s, time to first token, peak memory and KV-cache "
        "size (medians of --repeats runs after a warm-up).",
    )
    p.set_defaults(func=cmd_bench_generate)
    p.add_argument("run", help="run or checkpoint directory, or a spec file (random weights)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated (default: 1,8)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantize", choices=["int8"])
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, mps or auto")
    p.add_argument("--threads", type=_at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override (spec file)")
    p.add_argument("--weights", choices=["final", "best", "latest"], default="final")
    p.add_argument("--json", action="store_true", help="print the results as JSON")

    p = benches.add_parser(
        "kernels",
        help="time every registered attention, ffn or norm component: time, TFLOP/s, memory",
        description="Time every registered component of a kind (forward, and forward+backward) "
        "over sequence lengths and head dims (attention) or token counts (ffn, norm): median "
        "time, TFLOP/s (GB/s for norms), peak memory and the ratios against a baseline. "
        "Prints a table and writes JSON and a PNG plot under --out. FLOP counts and the memory "
        "measure are described in llmkit/bench/kernels.py.",
    )
    p.set_defaults(func=cmd_bench_kernels)
    p.add_argument("--kind", default="attention", help="attention (default), ffn or norm")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bf16 CUDA, fp32 CPU)")
    p.add_argument(
        "--seq-lens",
        help="comma-separated sequence lengths (attention) or token counts (ffn, norm); "
        "default 256…4096 on CPU, 512…8192 on CUDA (tokens: 256…4096, 4096…65536)",
    )
    p.add_argument("--head-dims", help="comma-separated attention head dims (default: 64,128)")
    p.add_argument("--components", help="comma-separated names (default: every registered one)")
    p.add_argument("--modes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both (default)")
    p.add_argument("--baseline", help="component the ratios compare with (default: sdpa, "
                   "swiglu, rmsnorm)")  # fmt: skip
    p.add_argument("--option", action="append", metavar="NAME.KEY=VALUE", help="an option")
    p.add_argument("--batch", type=int, help="attention batch (default: 1 CPU, 16384/N CUDA)")
    p.add_argument("--heads", type=int, help="attention heads (default: 8 CPU, 2048/D CUDA)")
    p.add_argument("--d-model", type=int, help="ffn/norm width (default: 768 CPU, 4096 CUDA)")
    p.add_argument(
        "--causal", action=argparse.BooleanOptionalAction, default=True, help="default: causal"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (median; default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    p.add_argument("--threads", type=_at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a few seconds in all")
    p.add_argument("--out", default="bench-kernels", help="where JSON and PNG go")
    return parser


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer ≥ ``minimum``."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be ≥ {minimum}, got {value}")
        return value

    return integer


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _seed(text: str) -> int:
    """An argparse type: a seed in [0, 2⁶³)."""
    value = _at_least(0)(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be < 2**63, got {value}")
    return value


def _version() -> str:
    from llmkit import __version__

    return f"llmkit {__version__}"


def _log_to_stderr() -> None:
    """Show llmkit's INFO log lines (e.g. a kernel falling back to its reference) as notes."""
    import logging

    logger = logging.getLogger("llmkit")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("note: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _error(message: str) -> int:
    """Print a user error as one line (naming the rank in a multi-process run)."""
    multi = os.environ.get("WORLD_SIZE", "1") not in ("", "1")
    where = f"[rank {os.environ.get('RANK', '?')}] " if multi else ""
    print(f"error: {where}{message}", file=sys.stderr)
    return EXIT_USER_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    _log_to_stderr()
    try:
        code = int(args.func(args) or 0)
    except LlmkitError as exc:
        if args.debug:
            raise
        code = _error(str(exc))
    except BrokenPipeError as exc:
        if args.debug or args.command == "train":  # training writes no pipe of its own
            if args.debug:
                raise
            code = _error(f"broken pipe: {exc}")
        else:
            # The reader went away (`llmkit generate … | head`): stop quietly, as Unix tools do.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            code = 141
    except OSError as exc:  # a path that cannot be used, a full disk, a permission
        if args.debug:
            raise
        where = f": {exc.filename}" if exc.filename else ""
        code = _error(f"{exc.strerror or exc}{where}")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    dist = sys.modules.get("llmkit.training.distributed")  # imported only by a training run
    if dist is not None:
        dist.exit_process(code)  # returns unless this process joined a process group
    return code

