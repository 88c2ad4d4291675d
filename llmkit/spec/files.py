"""Reading spec files: TOML/YAML, ``extends`` chains and presets, ``--set`` overrides."""

from __future__ import annotations

import copy
import difflib
import tomllib
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from llmkit.errors import LlmkitError, SpecError, first_line

PRESETS_DIR = Path(__file__).with_name("presets")


#: Nesting deeper than this is refused: no spec needs it, and deeper input only exhausts the
#: parser's (or the validator's) recursion.
MAX_DEPTH = 32
#: The most YAML nodes a document may expand to once its aliases are followed; anchors and
#: aliases within it are fine, an alias bomb ("billion laughs") is refused while parsing.
MAX_YAML_NODES = 100_000
#: The largest spec file read: specs are a few kilobytes; a bigger file is a mistake (or a
#: way to make parsing take minutes) and is refused before it is read.
MAX_SPEC_BYTES = 16 * 2**20
#: The longest ``extends`` chain (a file, its base, the base's base, ...).
MAX_EXTENDS = 32


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML or YAML file into a dict.

    Refused, each in one line naming the file: a path that is missing, a directory or not a
    regular file, a file that cannot be read, is larger than :data:`MAX_SPEC_BYTES` or is not
    UTF-8, invalid syntax (in the file's own format; values Python refuses too, such as an
    integer of more than 4,300 digits or a date that does not exist), YAML duplicate keys,
    YAML keys that are not strings, YAML aliases that expand past :data:`MAX_YAML_NODES`
    nodes, and nesting deeper than :data:`MAX_DEPTH`.
    """
    p = Path(path)
    text = _read_text(p)
    suffix = p.suffix.lower()
    if suffix == ".toml":
        data = _parse_toml(text, p)
    elif suffix in (".yaml", ".yml"):
        data = _parse_yaml(text, p)
    else:
        raise LlmkitError(f"{p}: unknown spec format {suffix!r} (use .toml, .yaml or .yml)")
    if not isinstance(data, dict):
        raise LlmkitError(f"{p}: a spec must be a table/mapping at the top level")
    _check_depth(data, p)
    # A YAML alias is the same object as its anchor: copied apart, so that editing one
    # place (--set, a merge) never edits the others (the loader bounds the expansion).
    return _unshared(data) if suffix != ".toml" else data


def _read_text(p: Path) -> str:
    """The text of the spec file ``p`` (a byte-order mark is allowed); each refusal names
    the file."""
    if not p.exists():
        raise LlmkitError(f"spec file not found: {p}")
    if p.is_dir():
        raise LlmkitError(f"{p}: is a directory, not a spec file")
    if not p.is_file():
        raise LlmkitError(f"{p}: not a regular file")
    try:
        with p.open("rb") as f:  # read at most one byte past the limit, whatever stat says
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise LlmkitError(f"{p}: cannot read the spec file: {exc.strerror or exc}") from exc
    if len(raw) > MAX_SPEC_BYTES:
        raise LlmkitError(f"{p}: larger than {MAX_SPEC_BYTES // 2**20} MiB; not a spec file")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise LlmkitError(f"{p}: not UTF-8 text (byte {exc.start}: {exc.reason})") from exc


def _unshared(node: Any) -> Any:
    """``node`` with every table and list copied, aliases included (no memo)."""
    if isinstance(node, dict):
        return {k: _unshared(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unshared(v) for v in node]
    return node


def _parse_toml(text: str, p: Path) -> Any:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LlmkitError(f"{p}: invalid TOML: {exc}") from exc
    except RecursionError as exc:
        raise LlmkitError(f"{p}: invalid TOML: nested more than {MAX_DEPTH} levels deep") from exc
    except ValueError as exc:  # a value Python refuses (an integer of 4,300+ digits)
        raise LlmkitError(f"{p}: invalid TOML: {_value_message(exc)}") from exc


def _parse_yaml(text: str, p: Path) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_spec_yaml_loader()) or {}
    except RecursionError as exc:
        raise LlmkitError(f"{p}: invalid YAML: nested more than {MAX_DEPTH} levels deep") from exc
    except yaml.YAMLError as exc:
        raise LlmkitError(f"{p}: invalid YAML: {_yaml_message(exc)}") from exc
    except (ValueError, OverflowError) as exc:  # a value Python refuses: a date that does
        # not exist, an integer of 4,300+ digits
        raise LlmkitError(f"{p}: invalid YAML: {_value_message(exc)}") from exc


def _value_message(exc: Exception) -> str:
    """A value Python refuses to build, as one line."""
    if "integer string conversion" in str(exc):
        return "an integer of more than 4300 digits"
    return first_line(exc, limit=200)


def _yaml_message(exc: Exception) -> str:
    """A PyYAML error as one line: the problem and where it is."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return first_line(exc)


def _check_depth(data: Any, p: Path) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH`, naming the file ``p``."""
    if _too_deep(data):
        raise LlmkitError(f"{p}: nested more than {MAX_DEPTH} levels deep")


def _too_deep(data: Any, depth: int = 1) -> bool:
    """Whether ``data``, at ``depth``, nests deeper than :data:`MAX_DEPTH` (iteratively: no
    recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(data, depth)]
    seen: set[int] = set()
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(node, dict | list) and id(node) not in seen:
            seen.add(id(node))  # a shared (aliased) table is walked once
            children = node.values() if isinstance(node, dict) else node
            stack.extend((c, depth + 1) for c in children)
    return False


_LOADER: type | None = None


def _spec_yaml_loader() -> type:
    """PyYAML's safe loader, stricter: duplicate keys are errors (TOML refuses them too), and
    a document whose aliases expand past :data:`MAX_YAML_NODES` nodes is refused while it
    is composed, before anything is built from it. Anchors and aliases are otherwise kept
    (the run directories' ``spec.yaml`` files use them for shared tables)."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml
    from yaml.events import AliasEvent
    from yaml.nodes import MappingNode, Node, SequenceNode

    class SpecLoader(yaml.SafeLoader):
        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self._sizes: dict[int, int] = {}

        def compose_node(self, parent: Node | None, index: Any) -> Node:
            alias = self.check_event(AliasEvent)
            node = super().compose_node(parent, index)
            key = id(node)
            if alias:
                if key not in self._sizes:  # an alias of a node still being composed
                    raise yaml.YAMLError(
                        f"recursive alias (line {node.start_mark.line + 1}): "
                        "a value cannot contain itself"
                    )
                return node
            if isinstance(node, MappingNode):
                children = [n for pair in node.value for n in pair]
            elif isinstance(node, SequenceNode):
                children = list(node.value)
            else:
                children = []
            size = 1
            for child in children:
                size += self._sizes[id(child)]
            if size > MAX_YAML_NODES:
                raise yaml.YAMLError(
                    f"aliases expand to more than {MAX_YAML_NODES:,} values (line "
                    f"{node.start_mark.line + 1}); write the values out, or use fewer aliases"
                )
            self._sizes[key] = size
            return node

        def construct_mapping(self, node: Node, deep: bool = False) -> dict[Any, Any]:
            if isinstance(node, MappingNode):
                first: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # `<<: *base` may be overridden by the keys beside it
                    key = self.construct_object(key_node, deep=deep)
                    line = key_node.start_mark.line + 1
                    if not isinstance(key, str) and isinstance(key, Hashable):
                        raise yaml.YAMLError(
                            f"key {key_node.value!r} at line {line} reads as "
                            f"{type(key).__name__} {key!r}, not a string: quote it"
                        )
                    try:
                        earlier = first.get(key)
                    except TypeError:
                        continue  # an unhashable key: the base class reports it
                    if earlier is not None:
                        raise yaml.YAMLError(
                            f"duplicate key {key!r} at line {line} (first at line {earlier})"
                        )
                    first[key] = line
            return super().construct_mapping(node, deep=deep)

    _LOADER = SpecLoader
    return SpecLoader


def presets() -> dict[str, Path]:
    """Preset names and their files."""
    return {p.stem: p for p in sorted(PRESETS_DIR.glob("*.toml"))}


def merge(
    base: dict[str, Any], child: dict[str, Any], path: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Deep-merge ``child`` over ``base``. A component table whose ``name`` changes is
    replaced, not merged, so one component's options never leak into another's (a table
    without ``name`` names its kind's default component)."""
    out = copy.deepcopy(base)
    for key, value in child.items():
        old = out.get(key)
        if (
            isinstance(old, dict)
            and isinstance(value, dict)
            and not ("name" in value and _other_component(old, value["name"], (*path, key)))
        ):
            out[key] = merge(old, value, (*path, key))
        else:
            out[key] = copy.deepcopy(value)
    return out


def _other_component(table: dict[str, Any], name: Any, path: tuple[str, ...]) -> bool:
    """Whether ``name`` chooses another component than ``table`` (at ``path``) holds: its
    own ``name``, or without one the default of the kind whose section it is."""
    if not path:  # the spec's own name, not a component's
        return False
    if "name" in table:
        return table["name"] != name
    if not table:
        return False
    from llmkit.spec.sections import default_component

    default = default_component(path)
    return default is not None and default != name


def load_raw(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a spec file and apply its ``extends`` chain (at most :data:`MAX_EXTENDS` files
    long)."""
    p = Path(path).resolve()
    if p in _seen:
        chain = " -> ".join(str(s) for s in (*_seen, p))
        raise LlmkitError(f"circular extends: {chain}")
    if len(_seen) >= MAX_EXTENDS:
        raise LlmkitError(
            f"{_seen[-1]}: extends: a chain of more than {MAX_EXTENDS} files (from {_seen[0]})"
        )
    data = read_spec_file(p)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise SpecError(["extends: must be a file path or a preset name"], str(path))
    candidate = p.parent / parent
    if candidate.is_dir():
        raise LlmkitError(f"{path}: extends: {candidate} is a directory, not a spec file")
    if candidate.suffix.lower() in (".toml", ".yaml", ".yml") or candidate.is_file():
        if not candidate.exists():
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
    except RecursionError:
        raise LlmkitError(f"--set value nested too deeply: {text[:40]}...") from None
    except ValueError as exc:  # a value Python refuses (an integer of 4,300+ digits)
        raise LlmkitError(f"--set value {text[:40]}...: {_value_message(exc)}") from None


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one dotted ``key.path=value`` in place."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise LlmkitError(f"--set {assignment!r}: expected KEY=VALUE, e.g. model.n_layers=4")
    parts = key.split(".")
    if len(parts) > MAX_DEPTH:
        raise LlmkitError(f"--set {key[:40]}…: nested more than {MAX_DEPTH} levels deep")
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
    if _too_deep(value, len(parts)):
        raise LlmkitError(f"--set {key}: nested more than {MAX_DEPTH} levels deep")
    if isinstance(node, list):
        try:
            node[int(last)] = value
        except (ValueError, IndexError) as exc:
            raise LlmkitError(f"--set {key}: no list element {key}") from exc
    elif isinstance(node, dict):
        if last == "name" and _other_component(node, value, tuple(parts[:-1])):
            node.clear()  # a different component: its options start from defaults
        node[last] = value
    else:
        raise LlmkitError(f"--set {key}: {'.'.join(parts[:-1])} is not a table")
