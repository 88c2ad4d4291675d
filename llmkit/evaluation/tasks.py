"""Downstream tasks from local JSONL files: a task spec says how each line becomes choices.

A task spec (TOML, or one of the built-in formats by name) renders each JSON object (a
*document*) with Jinja templates into an :class:`Item`: the (context, continuation) pairs
to score and the index of the right one. Three formats:

- ``multiple_choice``: one context, one continuation per choice (HellaSwag, ARC, PIQA);
- ``partial``: one context per choice and one shared continuation, scored only on the
  continuation (Winogrande's partial scoring, Sakaguchi et al. 2019 / lm-eval-harness);
- ``completion``: one context and the target continuation; right when greedy decoding
  produces exactly the target (LAMBADA's last word, Paperno et al. 2016).

Nothing is downloaded: a built-in format names the fields of the benchmark's usual JSONL
release, and the user gives the file (``--task hellaswag=path/to/hellaswag_val.jsonl``).

Task files are data from anywhere: a line longer than :data:`MAX_DOCUMENT_CHARS`, JSON
nested too deeply, a field of the wrong type (``choices`` must be a list of strings) or an
item longer than :data:`MAX_ITEM_CHARS` is refused in one line naming the file and line;
templates render in llmkit's bounded sandbox (:func:`llmkit.data.chat.bounded_template`);
a task's prompts may add up to :data:`MAX_TASK_CHARS`.
"""

from __future__ import annotations

import io
import random
import re
import tomllib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmkit.errors import LlmkitError, validation_problems
from llmkit.files import parse_json

Format = Literal["multiple_choice", "partial", "completion"]
#: The longest line (one document) of a task's JSONL file, in characters.
MAX_DOCUMENT_CHARS = 4 * 2**20
#: The most characters of one item's (context, continuation) pairs.
MAX_ITEM_CHARS = 16 * 2**20
#: The most documents a task evaluates (its items, their requests and scores live in memory).
MAX_DOCUMENTS = 500_000
#: The most characters of all a task's items (few-shot examples repeat in every prompt).
MAX_TASK_CHARS = 64 * 2**20


class TaskSpec(BaseModel):
    """How a JSONL file becomes scored items. Templates are Jinja (sandboxed) over one
    document's fields; a field path (``choices``, ``labels`` as a string) is dotted
    (``choices.text``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)
    format: Format = "multiple_choice"
    data: str | None = None  # the JSONL file; relative paths are from the task file
    #: The prompt (multiple_choice, completion). Unused by ``partial``.
    context: str = "{{ context }}"
    #: multiple_choice: the continuations; partial: the contexts. A field path holding a
    #: list, or a list of templates.
    choices: str | list[str] | None = None
    #: completion: the target; partial: the shared continuation.
    continuation: str | None = None
    #: Which choice is right: a template rendering to an index (0-based), to the text of a
    #: choice, or to one of ``labels``.
    gold: str = "{{ label }}"
    #: What the gold template may name instead of an index (ARC's "A".."D"): a field path
    #: holding a list, or a list of strings.
    labels: str | list[str] | None = None
    #: Between context and continuation (lm-eval-harness's ``target_delimiter``).
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    num_fewshot: int = Field(0, ge=0, le=64)
    #: A JSONL file the few-shot examples come from (default: ``data``, never the item
    #: being scored).
    fewshot_data: str | None = None
    description: str = ""  # text before the few-shot examples
    preprocess: Literal["hellaswag"] | None = None  # a built-in text clean-up of the fields

    @field_validator("choices", "labels")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("must not be an empty list")
        return v

    def check(self) -> None:
        """What the format needs."""
        if self.format in ("multiple_choice", "partial") and self.choices is None:
            raise LlmkitError(f"task {self.name}: a {self.format} task needs choices")
        if self.format in ("partial", "completion") and self.continuation is None:
            raise LlmkitError(f"task {self.name}: a {self.format} task needs continuation")


@dataclass(frozen=True)
class Item:
    """One scored question: the (context, continuation) pairs, one per choice (one pair for
    a completion), the index of the right pair, and the choices' texts as written."""

    pairs: tuple[tuple[str, str], ...]
    gold: int
    choice_texts: tuple[str, ...]
    doc_index: int

    def size(self) -> int:
        """Characters of the item's texts (one shared context counted once)."""
        return sum(len(s) for s in {id(s): s for pair in self.pairs for s in pair}.values())


@dataclass
class Task:
    """A task spec with its documents."""

    spec: TaskSpec
    docs: Sequence[dict[str, Any]]
    fewshot_docs: Sequence[dict[str, Any]] | None = None  # None: the task's own documents
    source: Path | None = None
    lines: Sequence[int] | None = None  # each document's line in ``source`` (1-based)

    @property
    def name(self) -> str:
        return self.spec.name

    def where(self, index: int) -> str:
        """Document ``index`` (0-based) for an error: ``task NAME, document N (FILE line L)``."""
        out = f"task {self.name}, document {index + 1}"
        if self.source is not None and self.lines is not None and 0 <= index < len(self.lines):
            out += f" ({self.source.name} line {self.lines[index]})"
        return out

    def items(
        self, *, num_fewshot: int | None = None, seed: int = 1234, limit: int | None = None
    ) -> list[Item]:
        """The task's items (the first ``limit``), each prompt with ``num_fewshot`` examples
        (default: the spec's) drawn with ``seed``: the same seed gives the same prompts. At
        most :data:`MAX_DOCUMENTS` items, whose prompts hold at most :data:`MAX_TASK_CHARS`."""
        k = self.spec.num_fewshot if num_fewshot is None else num_fewshot
        n = min(limit, len(self.docs)) if limit else len(self.docs)
        if n > MAX_DOCUMENTS:
            raise LlmkitError(
                f"task {self.name}: {n:,} documents, more than the limit of {MAX_DOCUMENTS:,} "
                "(llmkit.evaluation.tasks.MAX_DOCUMENTS); evaluate fewer (--limit)"
            )
        pool = self.fewshot_docs if self.fewshot_docs is not None else self.docs
        own = self.fewshot_docs is None
        if k and len(pool) - (1 if own else 0) < k:
            raise LlmkitError(
                f"task {self.name}: {k} few-shot examples asked for, but the few-shot pool "
                f"holds {len(pool)} documents"
            )
        render = Renderer(self.spec, where=self.where)
        shots: dict[int, str] = {}  # the solved examples drawn so far

        def shot(j: int) -> str:
            if j not in shots:
                shots[j] = render.example(pool[j])
            return shots[j]

        rng = random.Random(seed)
        out = []
        total = 0
        for i in range(n):
            doc = self.docs[i]
            prefix = self.spec.description
            if k:
                drawn = rng.sample(range(len(pool)), k + (1 if own else 0))
                picks = [j for j in drawn if not (own and j == i)][:k]
                prefix += "".join(shot(j) + self.spec.fewshot_delimiter for j in picks)
            item = render.item(doc, i, prefix)
            size = item.size()
            if size > MAX_ITEM_CHARS:
                raise LlmkitError(
                    f"{self.where(i)}: its prompts hold {size:,} characters, more than the "
                    f"limit of {MAX_ITEM_CHARS:,} (llmkit.evaluation.tasks.MAX_ITEM_CHARS)"
                )
            total += size
            if total > MAX_TASK_CHARS:
                raise LlmkitError(
                    f"task {self.name}: its prompts hold more than {MAX_TASK_CHARS:,} "
                    f"characters by {self.where(i)} (each repeats its {k} few-shot "
                    "examples); evaluate fewer documents (--limit) or fewer shots"
                )
            out.append(item)
        return out


# -- rendering --------------------------------------------------------------------------


def _hellaswag_text(text: str) -> str:
    """HellaSwag's clean-up of WikiHow markup (as lm-eval-harness does it)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(doc: dict[str, Any]) -> dict[str, Any]:
    fields = ("ctx_a", "ctx_b") if "ctx_a" in doc else ("ctx",)
    for name in (*fields, "activity_label"):
        _typed(doc, name, str, "a string")
    endings = _strings(_typed(doc, "endings", list, "a list of strings"), "endings")
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize() if "ctx_a" in doc else doc["ctx"]
    return {
        **doc,
        "query": _hellaswag_text(doc["activity_label"] + ": " + ctx),
        "endings": [_hellaswag_text(e) for e in endings],
    }


def _typed(doc: dict[str, Any], name: str, kind: type, what: str) -> Any:
    """Field ``name`` of ``doc``, which must be of ``kind`` (``what`` in the error)."""
    value = _field(doc, name)
    if not isinstance(value, kind):
        raise ValueError(f"field {name!r} must be {what}, got {_json_type(value)}")
    return value


def _strings(values: list[Any], what: str) -> list[str]:
    if not values:
        raise ValueError(f"{what} field is an empty list")
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise ValueError(
                f"{what} field must be a list of strings; item {i} is {_json_type(value)}"
            )
    return values


def _json_type(value: Any) -> str:
    """What a JSON value is, for an error."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}
    names.update({list: "a list", dict: "an object", type(None): "null"})
    return names.get(type(value), type(value).__name__)


PREPROCESS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"hellaswag": _hellaswag}


def _field(doc: dict[str, Any], path: str) -> Any:
    value: Any = doc
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(path)
        value = value[part]
    return value


class Renderer:
    """Renders a spec's templates over documents."""

    def __init__(self, spec: TaskSpec, where: Callable[[int], str] | None = None) -> None:
        self.spec = spec
        self.where = where or (lambda index: f"task {spec.name}, document {index + 1}")
        self._cache: dict[str, Any] = {}

    def _render(self, template: str, doc: dict[str, Any], what: str) -> str:
        """``template`` (the spec's ``what``) rendered over ``doc`` in llmkit's bounded
        sandbox; its errors as a ValueError naming ``what``."""
        from jinja2 import StrictUndefined
        from jinja2.exceptions import TemplateError

        from llmkit.data.chat import bounded_template

        try:
            t = self._cache.get(template)
            if t is None:
                t = self._cache[template] = bounded_template(
                    template, undefined=StrictUndefined, keep_trailing_newline=True
                )
            return t.render(**doc)
        except TemplateError as exc:
            raise ValueError(f"{what} template: {exc.message or type(exc).__name__}") from exc
        except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"{what} template: {type(exc).__name__}: {exc}") from exc

    def _list(self, value: str | list[str], doc: dict[str, Any], what: str) -> list[str]:
        """``what`` (choices or labels): the spec's templates rendered, or its field, a list
        of strings (labels may be numbers)."""
        if isinstance(value, list):
            return [self._render(t, doc, f"{what}[{i}]") for i, t in enumerate(value)]
        found = _field(doc, value)
        if not isinstance(found, list) or not found:
            raise ValueError(
                f"{what} field {value!r} is not a non-empty list (got {_json_type(found)})"
            )
        if what == "labels":  # ARC's labels are strings, some releases' numbers
            found = [str(x) if _json_type(x) == "a number" else x for x in found]
        return _strings(found, f"{what} {value!r}")

    def _gold(self, doc: dict[str, Any], choices: list[str]) -> int:
        raw = self._render(self.spec.gold, doc, "gold").strip()
        labels = self._list(self.spec.labels, doc, "labels") if self.spec.labels else None
        if labels and raw in labels:
            index = labels.index(raw)
        elif re.fullmatch(r"-?\d+", raw):
            index = int(raw)
        elif raw in choices:
            index = choices.index(raw)
        else:
            raise ValueError(f"gold {raw!r} is neither an index, a label nor a choice")
        if not 0 <= index < len(choices):
            raise ValueError(f"gold index {index} is outside the {len(choices)} choices")
        return index

    def _doc(self, doc: dict[str, Any]) -> dict[str, Any]:
        return PREPROCESS[self.spec.preprocess](doc) if self.spec.preprocess else doc

    def item(self, doc: dict[str, Any], index: int, prefix: str = "") -> Item:
        """The scored item of document ``index``, its context(s) after ``prefix``."""
        spec, delim = self.spec, self.spec.target_delimiter
        try:
            doc = self._doc(doc)
            if spec.format == "completion":
                assert spec.continuation is not None
                target = self._render(spec.continuation, doc, "continuation")
                ctx = prefix + self._render(spec.context, doc, "context")
                return Item(((ctx, delim + target),), 0, (target,), index)
            assert spec.choices is not None
            choices = self._list(spec.choices, doc, "choices")
            gold = self._gold(doc, choices)
            if spec.format == "partial":
                assert spec.continuation is not None
                cont = delim + self._render(spec.continuation, doc, "continuation")
                pairs = tuple((prefix + c, cont) for c in choices)
            else:
                ctx = prefix + self._render(spec.context, doc, "context")
                pairs = tuple((ctx, delim + c) for c in choices)
            return Item(pairs, gold, tuple(choices), index)
        except (KeyError, ValueError, TypeError, IndexError, AssertionError) as exc:
            raise LlmkitError(f"{self.where(index)}: {_reason(exc)}") from exc
        except Exception as exc:  # jinja2's UndefinedError, TemplateSyntaxError, SecurityError
            raise LlmkitError(f"{self.where(index)}: {exc}") from exc

    def example(self, doc: dict[str, Any]) -> str:
        """A solved example for few-shot prompts: the gold pair's text."""
        item = self.item(doc, -1)
        ctx, cont = item.pairs[item.gold]
        return ctx + cont


def _reason(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"no field {exc.args[0]!r}"
    return str(exc) or type(exc).__name__


# -- built-in formats ---------------------------------------------------------------------

_ARC = {
    "context": "Question: {{ question }}\nAnswer:",
    "choices": "choices.text",
    "labels": "choices.label",
    "gold": "{{ answerKey }}",
}

#: The fields of the common benchmarks' JSONL releases (the prompts are lm-eval-harness's).
BUILTIN: dict[str, dict[str, Any]] = {
    "hellaswag": {
        "preprocess": "hellaswag",
        "context": "{{ query }}",
        "choices": "endings",
        "gold": "{{ label }}",
    },
    "arc_easy": _ARC,
    "arc_challenge": _ARC,
    "piqa": {
        "context": "Question: {{ goal }}\nAnswer:",
        "choices": ["{{ sol1 }}", "{{ sol2 }}"],
        "gold": "{{ label }}",
    },
    "openbookqa": {**_ARC, "context": "{{ question_stem }}"},
    "winogrande": {
        "format": "partial",
        "choices": [
            "{{ sentence[:sentence.index('_')] }}{{ option1 }}",
            "{{ sentence[:sentence.index('_')] }}{{ option2 }}",
        ],
        "continuation": "{{ sentence[sentence.index('_') + 1:] | trim }}",
        "gold": "{{ (answer | int) - 1 }}",
    },
    "lambada": {
        "format": "completion",
        "context": "{{ text.rsplit(' ', 1)[0] }}",
        "continuation": "{{ text.rsplit(' ', 1)[1] }}",
    },
}


# -- loading ----------------------------------------------------------------------------


def read_jsonl(path: Path, what: str) -> Documents:
    """The JSON objects of a JSONL file, one per non-blank line."""
    return read_jsonl_lines(path, what)[0]


class Documents(Sequence[dict[str, Any]]):
    """A JSONL file's documents, kept as the text of their lines (one string, with offsets)
    and parsed each time one is read: a parsed document may take many times the memory of
    its text (``[[],[],…]``: 20×), a Python object per document 100 bytes or more."""

    def __init__(self, text: str, offsets: array[int], numbers: array[int], where: str) -> None:
        self._text, self._offsets, self.numbers, self._where = text, offsets, numbers, where

    def __len__(self) -> int:
        return len(self.numbers)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError(index)
        line = self._text[self._offsets[i] : self._offsets[i + 1]]
        return parse_json(line, f"{self._where}:{self.numbers[i]}")


def read_jsonl_lines(path: Path, what: str) -> tuple[Documents, Sequence[int]]:
    """The JSON objects of a JSONL file, one per non-blank line (:class:`Documents`), and
    their line numbers. A line longer than :data:`MAX_DOCUMENT_CHARS`, not JSON (or nested
    too deeply) or not an object is a one-line error naming the file and line."""
    if not path.is_file():
        raise LlmkitError(f"{what}: file not found: {path}")
    kept, offsets, numbers = io.StringIO(), array("q", [0]), array("I")
    with path.open(encoding="utf-8", errors="strict") as fh:
        try:
            n = 0
            while line := fh.readline(MAX_DOCUMENT_CHARS + 1):  # a line, or that much of it
                n += 1
                if len(line) > MAX_DOCUMENT_CHARS:
                    raise LlmkitError(
                        f"{what}: {path}:{n}: a line longer than {MAX_DOCUMENT_CHARS:,} "
                        "characters (llmkit.evaluation.tasks.MAX_DOCUMENT_CHARS)"
                    )
                if not line.strip():
                    continue
                if not isinstance(parse_json(line, f"{what}: {path}:{n}"), dict):
                    raise LlmkitError(f"{what}: {path}:{n}: not a JSON object")
                kept.write(line)
                offsets.append(offsets[-1] + len(line))
                numbers.append(n)
        except UnicodeDecodeError as exc:
            raise LlmkitError(f"{what}: {path} is not UTF-8 text ({exc.reason})") from None
    if not numbers:
        raise LlmkitError(f"{what}: {path} holds no documents")
    return Documents(kept.getvalue(), offsets, numbers, f"{what}: {path}"), numbers


def task_spec(data: dict[str, Any], where: str) -> TaskSpec:
    """A validated task spec; the first problem as a one-line error naming ``where``."""
    try:
        spec = TaskSpec.model_validate(data)
    except ValidationError as exc:
        raise LlmkitError(f"{where}: {validation_problems(exc, top='task')[0]}") from None
    spec.check()
    return spec


def load_task(ref: str | Path, *, data: str | Path | None = None) -> Task:
    """A task from a task spec file (``.toml``), or a built-in format by name with its data:
    ``"hellaswag=path.jsonl"`` or ``load_task("hellaswag", data=path)``."""
    text = str(ref)
    name, sep, given = text.partition("=")
    if sep and name in BUILTIN:
        return load_task(name, data=given)
    if text in BUILTIN:
        if data is None:
            raise LlmkitError(
                f"task {text} needs its data file: --task {text}=PATH.jsonl (llmkit downloads "
                "nothing)"
            )
        spec = task_spec({"name": text, **BUILTIN[text], "data": str(data)}, f"task {text}")
        return _with_docs(spec, Path.cwd())
    path = Path(text)
    if path.suffix.lower() != ".toml":
        known = ", ".join(sorted(BUILTIN))
        raise LlmkitError(f"task {text!r}: not a task file (.toml) nor a built-in format ({known})")
    if not path.is_file():
        raise LlmkitError(f"task file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise LlmkitError(f"{path}: not valid TOML: {exc}") from None
    raw.setdefault("name", path.stem)
    if data is not None:
        raw["data"] = str(Path(data).resolve())
    spec = task_spec(raw, str(path))
    return _with_docs(spec, path.parent)


def _with_docs(spec: TaskSpec, base: Path) -> Task:
    if spec.data is None:
        raise LlmkitError(f'task {spec.name}: no data file (set data = "FILE.jsonl")')
    source = base / spec.data
    docs, lines = read_jsonl_lines(source, f"task {spec.name}")
    fewshot = None
    if spec.fewshot_data is not None:
        fewshot = read_jsonl(base / spec.fewshot_data, f"task {spec.name} (few-shot)")
    return Task(spec, docs, fewshot, source, lines)
