"""Checks of a whole spec that need no data: what training would otherwise refuse only after
reading the corpus (or never, before running out of memory).

Every spec: the model's parameters, estimated from its shapes
(:func:`estimate_parameters`), stay under :data:`MAX_PARAMETERS` (:func:`size_problems`).
Spec files, as training recipes (:func:`recipe_problems`): the schedule fits in
``train.max_steps`` (warmup no longer than the run) and so do ``train.checkpoint_steps``; a
byte-level BPE vocabulary the run trains holds 256 bytes + the special tokens; a component
that adapts base weights (an adapter) comes with ``train.init_from``.

:func:`fit_warmup` scales a schedule's warmup down for a shorter ``--max-steps`` run.

No option is read by name: the components' options state these facts (the contract of
:class:`llmkit.options.ComponentOptions` and :class:`llmkit.options.WarmupOptions`): an ffn's
``parameter_count``, a component's ``needs_base_weights``, a schedule's ``warmup`` (through
:func:`llmkit.options.schedule_warmup`), ``warmup_option`` and ``with_warmup``. All of it is
torch-free, as are the built-in schedules these checks build.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import ValidationError

from llmkit.errors import LlmkitError, RegistryError
from llmkit.options import schedule_warmup
from llmkit.spec.models import Spec, TrainSpec
from llmkit.spec.sections import default_names, get_at, spec_kinds

#: The largest model a spec may describe (parameters, estimated from the shapes).
MAX_PARAMETERS = 10**12
#: Byte-level BPE starts from one token per byte (as ``llmkit.data.tokenizer.N_BYTES``).
BPE_BYTES = 256
SCHEDULE_KIND = "schedule"


def recipe_problems(rs: Any) -> list[str]:
    """Problems training would meet in a resolved spec (a :class:`ResolvedSpec`) before
    reading any data, each with its path: checked for spec files (:func:`load_spec`, which
    ``llmkit validate`` and ``llmkit train`` use), not for in-memory specs that only
    describe a model."""
    spec = rs.spec
    by_kind = {r.kind: (section, r) for section, r in rs.components.items() if r is not None}
    problems: list[str] = []
    if SCHEDULE_KIND in by_kind:
        problems += _schedule_problems(*by_kind[SCHEDULE_KIND], spec.train.max_steps)
    late = [s for s in spec.train.checkpoint_steps if s > spec.train.max_steps]
    if late:
        problems.append(
            f"train.checkpoint_steps: {late[0]} exceeds train.max_steps ({spec.train.max_steps})"
        )
    problems += _bpe_problems(spec)
    if spec.train.init_from is None:
        # the trainer's own check (llmkit.runs.adapter_base), repeated for validation: asked
        # of the components' options (ComponentOptions.needs_base_weights)
        problems += [
            f"{section}: adapters need train.init_from, the base weights they adapt"
            for section, r in rs.components.items()
            if r is not None and getattr(r.options, "needs_base_weights", False)
        ]
    return problems


def _schedule_error(schedule: Any, options: Any, total_steps: int) -> str | None:
    """Why ``schedule`` cannot be built for ``total_steps`` steps, or None."""
    try:
        schedule.load()(options, total_steps=total_steps)
    except (ValueError, LlmkitError) as exc:
        return str(exc)
    return None


def _schedule_problems(section: str, schedule: Any, max_steps: int) -> list[str]:
    warmup = schedule_warmup(schedule.options, max_steps)
    if warmup > max_steps:
        option = _warmup_option(schedule.options)
        where = f"{section}.{option}" if option else section
        return [f"{where}: {warmup} exceeds train.max_steps ({max_steps})"]
    error = _schedule_error(schedule.record, schedule.options, max_steps)
    return [f"{section}: {error} (train.max_steps = {max_steps})"] if error else []


def _bpe_problems(spec: Spec) -> list[str]:
    """A BPE vocabulary the run would train (no tokenizer file, none adopted from
    ``train.init_from`` or a distillation teacher) must hold every byte and special token."""
    tok, train = spec.tokenizer, spec.train
    if tok.kind != "bpe" or tok.path or train.init_from is not None or train.distill is not None:
        return []
    specials = len(dict.fromkeys(tok.special_tokens))
    least = BPE_BYTES + specials
    if tok.vocab_size is not None:
        vocab, where = tok.vocab_size, "tokenizer.vocab_size"
    else:
        vocab, where = spec.model.vocab_size, "model.vocab_size"
    if vocab >= least:
        return []
    return [
        f"{where}: {vocab} is too small for byte-level BPE: it needs at least {least} "
        f"({BPE_BYTES} bytes + {specials} special tokens)"
    ]


def generic_ffn_parameters(d_model: int) -> int:
    """The estimate of an ffn whose options do not count their parameters
    (``parameter_count`` None, the :class:`~llmkit.contracts.ComponentOptions` default): a
    two-layer MLP of 4·d_model hidden units without biases, the transformer's own, 8·d²."""
    return 8 * d_model * d_model


def ffn_parameters(options: Any, d_model: int, bias: bool) -> int:
    """An ffn's parameters as its options count them (``parameter_count``), else
    :func:`generic_ffn_parameters`."""
    count = getattr(options, "parameter_count", None)
    n = count(d_model, bias) if callable(count) else None
    return generic_ffn_parameters(d_model) if n is None else n


def estimate_parameters(spec: Spec, layers: list[Any]) -> int:
    """The model's parameters estimated from its shapes: embeddings, output head, attention
    projections (weights) and each layer's ffn (:func:`ffn_parameters`). For built-in
    components a close lower bound (norms, positional tables and attention biases are left
    out); llmkit's one estimate, for :func:`size_problems` and for how
    ``llmkit.model.build_problems`` builds."""
    m = spec.model
    d, heads, kv, hd = m.d_model, m.n_heads, m.kv_heads, m.dim_head
    total = m.vocab_size * d * (1 if m.tie_embeddings else 2)
    attention = d * (heads + 2 * kv) * hd + heads * hd * d
    for plan in layers:
        ffn = plan.get("ffn")
        total += attention + (ffn_parameters(ffn.options, d, m.bias) if ffn is not None else 0)
    return total


def size_problems(spec: Spec, layers: list[Any]) -> list[str]:
    """The model's size against :data:`MAX_PARAMETERS` (checked for every spec)."""
    n = estimate_parameters(spec, layers)
    if n <= MAX_PARAMETERS:
        return []
    return [
        f"model: about {_sci(n)} parameters (embeddings, attention and feed-forward "
        f"alone), above the limit of {_sci(MAX_PARAMETERS)}; make the model smaller"
    ]


def _sci(n: float) -> str:
    """``1.41e14``: a large count, short."""
    return f"{n:.3g}".replace("e+", "e")


def fit_warmup(
    data: dict[str, Any], max_steps: int, registry: Any = None
) -> tuple[str, str] | None:
    """For a run cut to ``max_steps`` by the command line: the ``--set`` assignment that
    scales the schedule's warmup down so the schedule fits, and a one-line note; None when
    it fits already, or when the spec (``data``, raw, before ``max_steps``) has no warmup
    or does not fit its own ``train.max_steps`` either (resolution then reports it).

    The warmup keeps its share of the spec's run (at least one step), reduced further
    while the schedule still cannot be built (a WSD decay also needs room).
    """
    if registry is None:
        from llmkit.registry import get_registry

        registry = get_registry()
    data = copy.deepcopy(data)
    default_names(data, registry)
    kind = next((k for k in spec_kinds(registry) if k.name == SCHEDULE_KIND), None)
    table = get_at(data, kind.section) if kind is not None else None
    if kind is None or not isinstance(table, dict) or not isinstance(table.get("name"), str):
        return None
    try:
        record = registry.get(SCHEDULE_KIND, table["name"])
        model = record.options_model()
        options = model.model_validate({k: v for k, v in table.items() if k != "name"})
    except (RegistryError, ValidationError):
        return None
    option = _warmup_option(options)
    if option is None:
        return None
    train = data.get("train") if isinstance(data.get("train"), dict) else {}
    own = train.get("max_steps", TrainSpec.model_fields["max_steps"].default)
    if not isinstance(own, int) or own < 1:
        return None
    warmup = schedule_warmup(options, own)
    if warmup <= 0:
        return None

    def fits(w: int) -> bool:
        return _schedule_error(record, options.with_warmup(w), max_steps) is None

    if fits(warmup) or _schedule_error(record, options, own) is not None:
        return None
    low, high = 0, min(max_steps, max(1, round(warmup * max_steps / own)))
    if not fits(low):
        return None
    while low < high:  # the largest warmup up to the scaled one that fits
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    note = (
        f"--max-steps {max_steps} is shorter than {kind.section}.{option} ({warmup}): "
        f"warmup scaled to {low} steps (the spec warms up for {warmup} of {own} steps)"
    )
    return f"{kind.section}.{option}={low}", note


def _warmup_option(options: Any) -> str | None:
    """The option that sets a schedule's warmup (``warmup_option``, with ``with_warmup``),
    or None when its options have none."""
    option = getattr(options, "warmup_option", None)
    return (
        option
        if isinstance(option, str) and callable(getattr(options, "with_warmup", None))
        else None
    )
