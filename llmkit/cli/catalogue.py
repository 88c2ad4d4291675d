"""What is registered and whether specs are valid: ``list``, ``show``, ``plugins``,
``validate`` and ``schema``. None of them imports torch: they read the components' options
models, which llmkit's own components (and plugins that name their ``options``) keep in
torch-free modules. ``validate --build`` builds the model and ``show --runtime`` imports the
component, both importing torch."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from llmkit.cli.common import (
    EXIT_USER_ERROR,
    add_set,
    console,
    load,
    registry,
    table,
    warn_failures,
)
from llmkit.errors import LlmkitError


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "list",
        run_list,
        help="list registered components (wildcards allowed)",
        configure=configure_list,
    )
    register(
        "show",
        run_show,
        help="show a component: summary, options, provider, capabilities",
        configure=configure_show,
    )
    register(
        "plugins",
        run_plugins,
        help="list plugins, what they provide, failures and overrides",
        configure=configure_plugins,
    )
    register(
        "validate",
        run_validate,
        help="validate spec files (--build: also build the model)",
        configure=configure_validate,
    )
    register(
        "schema",
        run_schema,
        help="write the JSON Schema of spec files",
        configure=configure_schema,
    )


# -- list -----------------------------------------------------------------------------------------


def configure_list(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", nargs="?", help="a component kind (default: every kind), or 'presets'")
    p.add_argument("pattern", nargs="?", help="name pattern, e.g. 'sw*'")


def run_list(args: argparse.Namespace) -> int:
    reg = registry()
    warn_failures(reg)
    kind, pattern = args.kind, args.pattern
    if kind in PRESETS and kind not in reg.kinds:
        return list_presets(pattern)
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
    out = table("kind", "name", "provider", "summary")
    for c in rows:
        out.add_row(c.kind, c.name, c.provider, c.summary)
    for key, conflict in sorted(reg.conflicts.items()):
        if conflict.winner is None and (kind is None or key.startswith(f"{kind}.")):
            out.add_row(*key.split(".", 1), " & ".join(conflict.providers), "[red]CONFLICT[/]")
    console().print(out)
    return 0 if rows else 1


#: ``llmkit list presets``: the spec presets shipped with llmkit, not a component kind.
PRESETS = ("presets", "preset")


def list_presets(pattern: str | None) -> int:
    """The presets (``extends = "<name>"``, ``llmkit info <name>``): name, what each extends
    and its file's leading comment up to the first closing parenthesis (the model and its
    source)."""
    import fnmatch

    from llmkit.spec.files import presets, read_spec_file

    out = table("preset", "extends", "summary")
    shown = 0
    for name, path in sorted(presets().items()):
        if pattern is not None and not fnmatch.fnmatchcase(name, pattern):
            continue
        parent = read_spec_file(path).get("extends")
        out.add_row(name, parent if isinstance(parent, str) else "-", _leading_comment(path))
        shown += 1
    console().print(out)
    return 0 if shown else 1


def _leading_comment(path: Any) -> str:
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    end = text.find(")")
    return text[: end + 1] if end >= 0 else text


# -- show -----------------------------------------------------------------------------------------


def configure_show(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind")
    p.add_argument("name")
    p.add_argument(
        "--runtime",
        action="store_true",
        help="also import the component: its own docstring and, for a kernel with a Triton or "
        "compiled path, which path it takes on this machine (imports torch)",
    )


def run_show(args: argparse.Namespace) -> int:
    rec = registry().get(args.kind, args.name)
    model = rec.options_model()  # a module that fails to import: a one-line RegistryError
    # The component itself (its module imports torch) is imported only with --runtime, or
    # when it is already at hand: a plugin that registered an object, or whose options were
    # found on its target. Otherwise the catalogue's summary and the options' own docstring
    # describe it.
    factory = rec.load() if args.runtime or not isinstance(rec.target, str) else None
    con = console()
    con.print(f"[bold]{rec.kind} {rec.name}[/]: {rec.summary}")
    con.print(f"provider: {rec.provider} {rec.version}")
    con.print(f"target:   {rec.target_path}")
    doc = _own_doc(factory) if factory is not None else _own_doc(model)
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
    out = table("option", "type", "default", "description", title="options")
    for name, f in fields.items():
        default = (
            "(required)" if f.is_required() else repr(f.get_default(call_default_factory=True))
        )
        out.add_row(name, _type_name(f.annotation), default, f.description or "")
    con.print(out)
    return 0


def _own_doc(obj: Any) -> str:
    """``obj``'s docstring; none for :class:`~llmkit.options.NoOptions`, whose docstring says
    nothing about the component."""
    from llmkit.options import NoOptions

    return "" if obj is NoOptions else (getattr(obj, "__doc__", None) or "").strip()


def _type_name(ann: Any) -> str:
    text = getattr(ann, "__name__", None) if isinstance(ann, type) else None
    return text or str(ann).replace("typing.", "")


# -- plugins --------------------------------------------------------------------------------------


def configure_plugins(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="list every component")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _installed_entry_points() -> dict[str, str]:
    """Installed ``llmkit`` entry points: name → distribution (no plugin is imported)."""
    import importlib.metadata as md

    out: dict[str, str] = {}
    for ep in md.entry_points(group="llmkit"):
        dist = getattr(ep, "dist", None)
        out.setdefault(ep.name, dist.metadata["Name"] if dist is not None else "?")
    return out


def _own(info: Any) -> bool:
    """One of llmkit's own plugins (components or commands)."""
    from llmkit.cli.commands import BUILTIN_COMMANDS
    from llmkit.registry import BUILTIN_PLUGIN

    return info.name in (BUILTIN_PLUGIN, BUILTIN_COMMANDS)


def _new_kinds(reg: Any, info: Any) -> list[str]:
    """The kinds a third-party plugin declared."""
    if _own(info):
        return []
    return sorted(k.name for k in reg.kinds.values() if k.provider == info.distribution)


def _commands_by_plugin(reg: Any) -> dict[str, list[str]]:
    """Plugin name → the commands it registered (``"bench kernels"`` for subcommands)."""
    from llmkit.cli.commands import load_commands

    out: dict[str, list[str]] = {}
    for cmd in load_commands(reg).commands:
        out.setdefault(cmd.plugin, []).append(cmd.key)
    return out


def _provides(reg: Any, info: Any, commands: list[str]) -> str:
    """What a plugin registered: new kinds, then a count per kind, then its commands."""
    by_kind: dict[str, list[str]] = {}
    for key in info.registered:
        kind, _, name = key.partition(".")
        by_kind.setdefault(kind, []).append(name)
    parts = []
    new_kinds = _new_kinds(reg, info)
    if new_kinds:
        parts.append(f"new kind {', '.join(new_kinds)}")
    for kind in sorted(by_kind):
        parts.append(f"{kind} {len(by_kind[kind])}")
    if commands:
        parts.append(f"command {len(commands)}")
    return "; ".join(parts) or "-"


def _plugins_report(reg: Any) -> dict[str, Any]:
    """Everything ``llmkit plugins`` shows, as data (also its ``--json`` output)."""
    import os

    from llmkit.registry import allowed_plugins

    commands = _commands_by_plugin(reg)
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
                "kinds": _new_kinds(reg, info),
                "commands": commands.get(info.name, []),
                "overridden": sorted(set(lost.get(info.distribution, []))),
            }
        )
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
        "allow_list": allowed_plugins(),
        "registry_file": os.environ.get("LLMKIT_REGISTRY") or None,
        "strict": bool(getattr(reg, "strict", False)),
    }


def run_plugins(args: argparse.Namespace) -> int:
    reg = registry()
    report = _plugins_report(reg)
    unresolved = [c for c in report["conflicts"] if c["winner"] is None]
    code = 1 if reg.failures() or unresolved else 0
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
        return code
    con = console()
    out = table("plugin", "distribution", "version", "provides", "status")
    for p in report["plugins"]:
        info = reg.plugins[p["name"]]
        if p["error"]:
            status = "[red]FAILED[/] (below)"
        elif p["overridden"]:
            status = f"ok, [yellow]{len(p['overridden'])} not used[/] (below)"
        else:
            status = "ok"
        provides = _provides(reg, info, p["commands"]) if not p["error"] else "nothing"
        out.add_row(p["name"], p["distribution"], p["version"], provides, status)
    for s in report["not_loaded"]:
        out.add_row(s["name"], s["distribution"], "", "", "[dim]off[/]")
    con.print(out)
    if report["not_loaded"]:
        allow = ",".join(report["allow_list"] or [])
        con.print(f"off: installed but not loaded, as LLMKIT_PLUGINS={allow!r}", markup=False)
    if args.verbose:
        _print_registered(con, reg, report)
    _print_problems(con, report, unresolved)
    return code


def _print_registered(con: Any, reg: Any, report: dict[str, Any]) -> None:
    """One line per plugin: every component it registered (and which lost), its commands."""
    commands = {p["name"]: p["commands"] for p in report["plugins"]}
    for info in sorted(reg.plugins.values(), key=lambda p: p.name):
        names = []
        for key in info.registered:
            conflict = reg.conflicts.get(key)
            if conflict is None or conflict.winner == info.distribution:
                names.append(key)
            elif conflict.winner is None:
                names.append(f"{key} (unusable: conflict)")
            else:
                names.append(f"{key} (overridden by {conflict.winner})")
        names += [f"command '{key}'" for key in commands.get(info.name, [])]
        if names:
            con.print(f"{info.name}: {', '.join(names)}", markup=False)


def _print_problems(con: Any, report: dict[str, Any], unresolved: list[dict[str, Any]]) -> None:
    """Failed plugins, settled clashes and unresolved conflicts, each with what to do."""
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


# -- validate and schema ------------------------------------------------------------------------


def configure_validate(p: argparse.ArgumentParser) -> None:
    p.add_argument("specs", nargs="+", metavar="SPEC")
    add_set(p)
    p.add_argument("--resolved", action="store_true", help="print the resolved spec as JSON")
    p.add_argument(
        "--build",
        action="store_true",
        help="also build the model (on the meta device, or on the CPU when small) to catch "
        "what only the components check, e.g. RoPE's even rotary dims; imports torch",
    )


def run_validate(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from llmkit.errors import SpecError

    warn_failures(registry())
    failed = 0
    con, err = console(), console(stderr=True)
    for path in args.specs:
        try:
            rs = load(path, args.set)
        except SpecError as exc:
            failed += 1
            err.print(f"[red]✗[/] {escape(str(exc))}", markup=True, highlight=False)
            continue
        except LlmkitError as exc:
            failed += 1
            err.print(f"[red]✗[/] {escape(str(exc))}", markup=True)
            continue
        note = " (model not built; --build checks it)"
        if args.build:
            # What only the components know (e.g. RoPE's even rotary dims): build it. Only
            # on request: the model's code imports torch, which the checks above never do.
            from llmkit.model import build_problems

            problems = build_problems(rs)
            if problems:
                failed += 1
                err.print(
                    f"[red]✗[/] {escape(str(path))}: the model does not build: "
                    f"{escape('; '.join(problems))}",
                    markup=True,
                )
                continue
            note = ", the model builds"
        # With --resolved, stdout carries only the JSON (pipeable); the verdict goes to stderr.
        verdict = f"[green]✓[/] {escape(str(path))}: {len(rs.layers)} layers, valid{note}"
        (err if args.resolved else con).print(verdict, markup=True)
        if args.resolved:
            con.print_json(json.dumps(rs.to_dict()))
    return EXIT_USER_ERROR if failed else 0


def configure_schema(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", help="file to write (default: stdout)")


def run_schema(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from llmkit.spec.schema import spec_schema

    reg = registry()
    warn_failures(reg)  # their components are missing from the schema
    broken = reg.unloadable()
    for rec, why in broken:  # one broken component module leaves only itself out
        console(stderr=True).print(
            f"[yellow]warning:[/] schema: left out {rec.kind} {rec.name!r} from "
            f"{rec.provider}, which failed to load: {escape(why)}",
            markup=True,
            highlight=False,
        )
    text = json.dumps(spec_schema(reg.without(rec.key for rec, _ in broken)), indent=2)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
        console(stderr=True).print(f"wrote {args.output}")
    else:
        sys.stdout.write(text + "\n")
    return 0
