"""Chat templates: Jinja2 strings rendered as Hugging Face's ``apply_chat_template`` renders
them (a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, the variables
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``pad_token`` and
``unk_token``, and ``raise_exception``), and conversations cut into prompt and response
text.

Which text is the assistant's is found by rendering prefixes of the conversation: the
response of turn ``i`` is what ``messages[:i+1]`` adds to ``messages[:i]`` rendered with the
generation prompt. That is exactly what a model sees at generation time (the prompt
rendered and tokenized alone, the reply generated after it), and it works for any template
whose renderings of a conversation's prefixes are prefixes of each other.

Every Jinja template llmkit renders (chat templates, imported or from ``data.source``, and
downstream tasks' templates) is compiled by :func:`bounded_template`: Jinja's immutable
sandbox with limits on work — ``range()`` gives at most :data:`MAX_RANGE` items, one
rendering takes at most :data:`MAX_STEPS` loop iterations and calls and
:data:`RENDER_SECONDS`, and neither its output nor any string, list or integer it builds
may exceed :data:`MAX_OUTPUT_CHARS` characters (:data:`MAX_INT_BITS` bits). A template over
a limit fails with a one-line ``SecurityError`` that says which limit.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from llmkit.errors import LlmkitError, first_line
from llmkit.files import parse_json

#: The special-token variables a template may use, as Hugging Face passes them.
TOKEN_VARIABLES = ("bos_token", "eos_token", "pad_token", "unk_token")
#: The most characters a conversation's messages may hold (chat data; larger records are
#: refused, naming their file and line).
MAX_CONVERSATION_CHARS = 4 * 2**20
#: The most characters the renderings of one conversation's prefixes may add up to (a
#: conversation with many assistant turns is rendered once per turn).
MAX_CONVERSATION_WORK = 256 * 2**20

Message = Mapping[str, str]


class ChatTemplateError(LlmkitError):
    """A template that does not compile or render, or a conversation it cannot cut."""


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


@functools.lru_cache(maxsize=16)
def compile_template(template: str, source: str = "chat template") -> Any:
    """The compiled template (:func:`bounded_template`, cached per text); a syntax error
    names ``source`` (where the template came from) and its line."""
    from jinja2 import TemplateSyntaxError

    try:
        return bounded_template(
            template, {"raise_exception": _raise_exception}, trim_blocks=True, lstrip_blocks=True
        )
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"{source}: Jinja syntax error at line {exc.lineno}: {exc.message}"
        ) from exc


def render(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    tokens: Mapping[str, str | None] | None = None,
    source: str = "chat template",
) -> str:
    """``messages`` rendered with ``template``; ``tokens`` fills the special-token
    variables (absent ones render as empty strings). Errors (the template's, or a limit of
    :func:`bounded_template`) are one line naming ``source``."""
    from jinja2.exceptions import TemplateError

    values = {name: (tokens or {}).get(name) or "" for name in TOKEN_VARIABLES}
    try:
        return compile_template(template, source).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **values,
        )
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(f"{source}: {exc.message or type(exc).__name__}") from exc
    except Exception as exc:  # a template may fail in any way (types, arithmetic…)
        raise ChatTemplateError(f"{source}: {type(exc).__name__}: {first_line(exc)}") from exc


def segments(
    template: str,
    messages: Sequence[Message],
    *,
    tokens: Mapping[str, str | None] | None = None,
    mask_prompt: bool = True,
    source: str = "chat template",
) -> list[tuple[str, bool]]:
    """The conversation's text in order as ``(text, trained)`` pieces: with
    ``mask_prompt`` the assistant turns (content and the template's end-of-turn text) are
    trained and everything else is not; without it, the whole text is trained. Refused:
    messages of more than :data:`MAX_CONVERSATION_CHARS` characters, and renderings adding
    up to more than :data:`MAX_CONVERSATION_WORK`."""
    size = sum(len(m["content"]) for m in messages)
    if size > MAX_CONVERSATION_CHARS:
        raise ChatTemplateError(
            f"the conversation holds {size:,} characters, more than the limit of "
            f"{MAX_CONVERSATION_CHARS:,} (llmkit.data.chat.MAX_CONVERSATION_CHARS); split it"
        )
    work = 0

    def rendered(upto: int, prompt: bool = False) -> str:
        nonlocal work
        text = render(
            template, messages[:upto], add_generation_prompt=prompt, tokens=tokens, source=source
        )
        work += len(text)
        if work > MAX_CONVERSATION_WORK:
            raise ChatTemplateError(
                f"rendering the conversation once per assistant turn ({len(messages)} "
                f"messages) takes more than {MAX_CONVERSATION_WORK:,} characters "
                "(llmkit.data.chat.MAX_CONVERSATION_WORK); split it into shorter ones"
            )
        return text

    whole = rendered(len(messages))
    if not mask_prompt:
        return [(whole, True)] if whole else []
    out: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = rendered(i, prompt=True)
        turn = rendered(i + 1)
        if not (prompt.startswith(done) and turn.startswith(prompt)):
            raise ChatTemplateError(
                f"{source}: the rendering of messages[:{i + 1}] does not extend that of "
                f"messages[:{i}] with the generation prompt, so the assistant's text of "
                f"messages[{i}] cannot be found; use a template whose turns only append text"
            )
        out += [(prompt[len(done) :], False), (turn[len(prompt) :], True)]
        done = turn
    if not whole.startswith(done):
        raise ChatTemplateError(
            f"{source}: the whole conversation does not extend its last assistant turn"
        )
    out.append((whole[len(done) :], False))
    return [(text, trained) for text, trained in out if text]


class ChatEncoder:
    """The ``datasets.map`` function of chat data: for each conversation (JSON messages),
    its ids, a 0/1 mask of the ids trained on, and its rendered text's UTF-8 bytes. Holds
    the tokenizer as JSON so it pickles cheaply into worker processes."""

    def __init__(
        self,
        tokenizer_json: str,
        template: str,
        tokens: Mapping[str, str | None],
        mask_prompt: bool,
    ) -> None:
        self.tokenizer_json = tokenizer_json
        self.template = template
        self.tokens = dict(tokens)
        self.mask_prompt = mask_prompt
        self._tok: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}

    def __call__(self, messages: list[str], where: list[str]) -> dict[str, list[Any]]:
        if self._tok is None:
            from llmkit.data.tokenizer import Tokenizer

            self._tok = Tokenizer.from_str(self.tokenizer_json)
        pieces: list[list[tuple[str, bool]]] = []
        for conv, at in zip(messages, where):
            try:
                pieces.append(
                    segments(
                        self.template,
                        parse_json(conv, at),
                        tokens=self.tokens,
                        mask_prompt=self.mask_prompt,
                    )
                )
            except ChatTemplateError as exc:
                raise ChatTemplateError(f"{at}: {exc}") from None
        flat = [text for conv in pieces for text, _ in conv]
        encs = iter(self._tok.encode_batch(flat))  # bounded calls; long texts in pieces
        ids, mask, n_bytes = [], [], []
        for conv in pieces:
            row_ids: list[int] = []
            row_mask: list[int] = []
            for _text, trained in conv:
                piece = next(encs)
                row_ids += piece
                row_mask += [int(trained)] * len(piece)
            ids.append(row_ids)
            mask.append(row_mask)
            n_bytes.append(sum(len(text.encode("utf-8")) for text, _ in conv))
        return {"ids": ids, "mask": mask, "n_bytes": n_bytes}


# -- bounded templates ------------------------------------------------------------------------

#: The most items ``range()`` gives a template.
MAX_RANGE = 10_000
#: The most loop iterations and calls (functions, macros, filters) of one rendering.
MAX_STEPS = 1_000_000
#: The most characters (or items) of a rendering's output and of anything it builds.
MAX_OUTPUT_CHARS = 16 * 2**20
#: The largest integer a template's arithmetic may build, in bits.
MAX_INT_BITS = 1 << 16
#: The longest one rendering may take (wall clock, seconds), checked as it runs.
RENDER_SECONDS = 10.0
#: Widths a template may ask of a filter or a string method (``center``, ``indent``…).
MAX_WIDTH = 10_000

_ITER, _SIZED = "llmkit_bounded_iter", "llmkit_bounded_size"  # filters the guard inserts
#: printf-style fields and str.format fields with a width or precision.
_WIDTHS = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d+))?|\{[^{}]*?:[^{}\d]*(\d+)(?:\.(\d+))?")


class _Budget:
    """The work left to one rendering: its steps, and its deadline (read every 256)."""

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + RENDER_SECONDS

    def tick(self, steps: int = 1) -> None:
        self.steps += steps
        if self.steps > MAX_STEPS:
            raise _limit(f"more than {MAX_STEPS:,} loop iterations and calls")
        if not self.steps & 255 and time.monotonic() > self.deadline:
            raise _limit(f"rendering took longer than {RENDER_SECONDS:g} s")


_BUDGET: ContextVar[_Budget | None] = ContextVar("llmkit_template_budget", default=None)


def _limit(what: str) -> Exception:
    from jinja2.exceptions import SecurityError

    return SecurityError(f"template limit: {what}")


def _tick() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.tick()


def _sized(value: Any) -> Any:
    """``value``, refused when it is a string or collection over :data:`MAX_OUTPUT_CHARS`."""
    if isinstance(value, str | list | tuple | dict) and len(value) > MAX_OUTPUT_CHARS:
        what = "characters" if isinstance(value, str) else "items"
        raise _limit(f"built {len(value):,} {what} (at most {MAX_OUTPUT_CHARS:,})")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _limit(f"built an integer of more than {MAX_INT_BITS:,} bits")
    return value


def _check_size(n: int) -> None:
    if n > MAX_OUTPUT_CHARS:
        raise _limit(f"would build {n:,} characters (at most {MAX_OUTPUT_CHARS:,})")


def _check_width(value: Any, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_WIDTH:
        raise _limit(f"{what} {value:,} (at most {MAX_WIDTH:,})")


def _check_format(fmt: Any) -> None:
    """Field widths and precisions of a printf or ``str.format`` string."""
    if isinstance(fmt, str):
        for match in _WIDTHS.finditer(fmt):
            for number in match.groups():
                if number and (len(number) > 6 or int(number) > MAX_WIDTH):
                    raise _limit(f"a format width of {number} (at most {MAX_WIDTH:,})")


def _count(value: Any) -> int:
    return len(value) if isinstance(value, str | list | tuple | dict) else 0


def _check_binop(op: str, left: Any, right: Any) -> None:
    """Refuse ``left op right`` before it builds something too large."""
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
    if op == "*":
        if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise _limit(f"an integer product of more than {MAX_INT_BITS:,} bits")
        for seq, n in ((left, right), (right, left)):
            if isinstance(n, int) and _count(seq):
                _check_size(_count(seq) * max(n, 0))
    elif op == "**" and ints and right > 0 and abs(left) > 1:
        if left.bit_length() * right > MAX_INT_BITS:
            raise _limit(f"a power of more than {MAX_INT_BITS:,} bits")
    elif op == "+":
        _check_size(_count(left) + _count(right))
    elif op == "%" and isinstance(left, str):
        _check_format(left)
        for arg in right if isinstance(right, tuple) else (right,):
            _check_width(arg, "a format width")


def _check_call(name: str, value: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Refuse the filter ``name`` (or string method ``str.name``) of ``value`` when its
    arguments would make it build too much."""
    given = [*args, *kwargs.values()]
    first = next(iter(given), None)
    if name in _WIDTH_ARGS:
        for arg in given:
            _check_width(arg, f"{name}() width")
    if not isinstance(value, str | list | tuple):
        return
    if name == "indent":
        pad = len(first) if isinstance(first, str) else first if isinstance(first, int) else 4
        _check_size(len(value) + (value.count("\n") + 1) * pad)
    elif name == "wordwrap":
        wrap = kwargs.get("wrapstring", given[2] if len(given) > 2 else "\n")
        width = first if isinstance(first, int) and first > 0 else 1
        _check_size(len(value) + (len(value) // width + 1) * _count(wrap))
    elif name == "str.expandtabs":
        _check_size(len(value) + value.count("\t") * (first if isinstance(first, int) else 8))
    elif name in ("replace", "str.replace") and len(given) >= 2:
        old, new = given[0], given[1]
        if isinstance(value, str) and isinstance(old, str) and isinstance(new, str):
            hits = len(value) + 1 if not old else value.count(old)
            _check_size(len(value) + hits * len(new))
    elif name in ("join", "str.join"):
        sep, items = (value, first) if name == "str.join" else (first, value)
        if isinstance(items, list | tuple):
            _check_size(_count(sep) * len(items) + sum(_count(i) for i in items))
    elif name in ("format", "str.format", "str.format_map"):
        _check_format(value)
        for arg in given:
            _check_width(arg, "a format width")


#: Filters and string methods whose integer arguments are widths or counts of pieces.
_WIDTH_ARGS = frozenset(
    {"center", "indent", "tojson", "slice", "batch"}
    | {f"str.{m}" for m in ("center", "ljust", "rjust", "zfill", "expandtabs")}
)


def _bounded_range(*args: int) -> range:
    for arg in args:
        if isinstance(arg, int) and abs(arg) > 2**62:
            raise _limit(f"range() of more than {MAX_RANGE:,} items")
    items = range(*args)
    if len(items) > MAX_RANGE:
        raise _limit(f"range() of {len(items):,} items (at most {MAX_RANGE:,})")
    return items


def _bounded_iter(items: Iterable[Any]) -> Iterator[Any]:
    """A ``for`` loop's items, each a step of the rendering's budget."""
    budget = _BUDGET.get()
    for item in items:
        if budget is not None:
            budget.tick()
        yield item


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    passes = getattr(func, "jinja_pass_arg", None) is not None  # context/environment first

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        given = args[1:] if passes else args
        if given:
            _check_call(name, given[0], given[1:], kwargs)
        return _sized(func(*args, **kwargs))

    return bounded


@functools.lru_cache(maxsize=8)
def _environment(options: tuple[tuple[str, Any], ...]) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return _sized(super().call_binop(context, operator, left, right))

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            _tick()
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner = getattr(method, "__self__", None)
            if isinstance(owner, str):
                _check_call(f"str.{getattr(method, '__name__', '')}", owner, args, kwargs)
            return _sized(super().call(__context, __obj, *args, **kwargs))

        def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
            """The output (and each macro's and captured block's): refused past
            :data:`MAX_OUTPUT_CHARS`, the deadline checked as it grows."""
            out, size, budget = [], 0, _BUDGET.get()
            for i, piece in enumerate(pieces):
                size += len(piece)
                if size > MAX_OUTPUT_CHARS:
                    raise _limit(f"an output of more than {MAX_OUTPUT_CHARS:,} characters")
                if budget is not None and not i & 1023 and time.monotonic() > budget.deadline:
                    raise _limit(f"rendering took longer than {RENDER_SECONDS:g} s")
                out.append(piece)
            return "".join(out)

    env = BoundedEnvironment(**dict(options))
    env.globals["range"] = _bounded_range
    env.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters[_ITER] = _bounded_iter
    env.filters[_SIZED] = _sized
    return env


def _guard(tree: Any) -> Any:
    """The template's syntax tree with each ``for`` loop's items counted
    (:func:`_bounded_iter`) and each ``~`` concatenation's size checked."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def wrap(node: Any, name: str) -> Any:
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    class Guard(NodeTransformer):
        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = wrap(node.iter, _ITER)
            return node

        def visit_Concat(self, node: Any) -> Any:
            return wrap(self.generic_visit(node), _SIZED)

    return Guard().visit(tree)


class BoundedTemplate:
    """A template compiled by :func:`bounded_template`; :meth:`render` runs it within the
    limits."""

    def __init__(self, template: Any) -> None:
        self.template = template

    def render(self, **variables: Any) -> str:
        token = _BUDGET.set(_Budget())
        try:
            return self.template.render(**variables)
        finally:
            _BUDGET.reset(token)


def bounded_template(
    source: str, globals: Mapping[str, Any] | None = None, **options: Any
) -> BoundedTemplate:
    """``source`` compiled in Jinja's immutable sandbox (``options``: the environment's,
    such as ``trim_blocks`` or ``undefined``) with bounded work (see the module docstring):
    llmkit's one way to render a template it did not write. ``globals``: functions and
    values the template may use besides Jinja's. A syntax error raises Jinja's
    ``TemplateSyntaxError``; a limit reached while rendering, its ``SecurityError``."""
    env = _environment(tuple(sorted(options.items())))
    code = env.compile(_guard(env.parse(source)))
    return BoundedTemplate(env.template_class.from_code(env, code, env.make_globals(globals)))
