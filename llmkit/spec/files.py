"""Reading spec files: TOML/YAML, ``extends`` chains and presets, ``--set`` overrides."""

from __future__ import annotations

import copy
import difflib
import tomllib
from pathlib import Path
from typing import Any

from llmkit.errors import LlmkitError, SpecError

PRESETS_DIR = Path(__file__).with_name("presets")


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML or YAML file into a dict."""
    p = Path(path)
    if not p.is_file():
        raise LlmkitError(f"spec file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark is allowed
    except UnicodeDecodeError as exc:
        raise LlmkitError(f"{p}: not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise LlmkitError(f"{p}: unknown spec format {suffix!r} (use .toml, .yaml or .yml)")
    except tomllib.TOMLDecodeError as exc:
        raise LlmkitError(f"{p}: invalid TOML: {exc}") from exc
    except Exception as exc:
        if isinstance(exc, LlmkitError):
            raise
        raise LlmkitError(f"{p}: invalid YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise LlmkitError(f"{p}: a spec must be a table/mapping at the top level")
    return data


def presets() -> dict[str, Path]:
    """Preset names and their files."""
    return {p.stem: p for p in sorted(PRESETS_DIR.glob("*.toml"))}


def merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``child`` over ``base``. A component table whose ``name`` changes is
    replaced, not merged, so one component's options never leak into another's."""
    out = copy.deepcopy(base)
    for key, value in child.items():
        old = out.get(key)
        if (
            isinstance(old, dict)
            and isinstance(value, dict)
            and not ("name" in value and "name" in old and value["name"] != old["name"])
        ):
            out[key] = merge(old, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_raw(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a spec file and apply its ``extends`` chain."""
    p = Path(path).resolve()
    if p in _seen:
        chain = " -> ".join(str(s) for s in (*_seen, p))
        raise LlmkitError(f"circular extends: {chain}")
    data = read_spec_file(p)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise SpecError(["extends: must be a file path or a preset name"], str(path))
    candidate = p.parent / parent
    if candidate.suffix.lower() in (".toml", ".yaml", ".yml") or candidate.is_file():
        if not candidate.is_file():
            raise LlmkitError(f"{path}: extends: file not found: {candidate}")
        base = load_raw(candidate, (*_seen, p))
    else:
        known = presets()
        if parent not in known:
            close = difflib.get_close_matches(parent, list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise LlmkitError(
                f"{path}: extends: no file or preset named {parent!r}{hint}; "
                f"presets: {', '.join(known) or 'none'}"
            )
        base = load_raw(known[parent], (*_seen, p))
    return merge(base, data)


def parse_value(text: str) -> Any:
    """A ``--set`` value: TOML syntax (numbers, booleans, arrays, inline tables) or a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one dotted ``key.path=value`` in place."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise LlmkitError(f"--set {assignment!r}: expected KEY=VALUE, e.g. model.n_layers=4")
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            try:
                node = node[int(part)]
            except (ValueError, IndexError) as exc:
                where = ".".join(parts[: i + 1])
                raise LlmkitError(f"--set {key}: no list element {where}") from exc
            continue
        if not isinstance(node, dict):
            raise LlmkitError(f"--set {key}: {'.'.join(parts[:i])} is not a table")
        node = node.setdefault(part, {})
    last = parts[-1]
    value = parse_value(raw.strip())
    if isinstance(node, list):
        try:
            node[int(last)] = value
        except (ValueError, IndexError) as exc:
            raise LlmkitError(f"--set {key}: no list element {key}") from exc
    elif isinstance(node, dict):
        if last == "name" and node.get("name") not in (None, value):
            node.clear()  # a different component: its options start from defaults
        node[last] = value
    else:
        raise LlmkitError(f"--set {key}: {'.'.join(parts[:-1])} is not a table")
