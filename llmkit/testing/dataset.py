"""The ``dataset`` kind: corpus sources ``Source(options)`` with ``splits(seed)``,
``describe()`` and optionally ``fingerprint()`` (:mod:`llmkit.components.dataset`)."""

from __future__ import annotations

from typing import Any

import torch

from llmkit.errors import LlmkitError
from llmkit.testing.common import (
    Options,
    Record,
    _expect,
    _fail,
    _load,
    _options_model,
    _run,
    build_options,
)

SPLITS = ("train", "validation")


def check_dataset(
    record: Record,
    options: Options = None,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> None:
    """Check a corpus source ``Source(options)``.

    ``splits(seed)`` returns a DatasetDict-like mapping with ``"train"`` and ``"validation"``,
    each with a string ``"text"`` column and at least one document; the same seed gives the
    same splits; train and validation are distinct datasets and, with two documents or more,
    validation is not a copy of train's rows (some validation text is not in train).
    ``describe()`` is a non-empty one-line string, before and after ``splits``; ``fingerprint()``,
    if defined, is a string, the same on two calls.

    Without ``options`` a source may need some to be useful (the file sources' ``paths``):
    when its options model has required fields, or building it or ``splits`` with its defaults
    raises :class:`~llmkit.errors.LlmkitError` (llmkit's error for a configuration the user has
    to complete), only the generic part runs: the options model and the target, as
    :func:`~llmkit.testing.check_generic` does. Pass options (e.g. small files in a temporary
    directory) to check the rest. ``device`` is accepted for a uniform signature and unused.
    """
    source_cls = _load(record)
    model = _options_model(record)
    required = [n for n, f in model.model_fields.items() if f.is_required()]
    if not options and required:
        return  # needs options it has no defaults for: the generic part only
    opts = build_options(record, options)
    given = bool(options)

    def attempt(what: str, fn: Any, *args: Any) -> tuple[bool, Any]:
        """(True, result), or (False, None) when the defaults need completing."""
        try:
            return True, fn(*args)
        except AssertionError:
            raise
        except LlmkitError as exc:
            if not given:
                return False, None
            _fail(record, f"{what} raised LlmkitError: {exc}")
        except Exception as exc:
            _fail(record, f"{what} raised {type(exc).__name__}: {exc}")

    ok, source = attempt(f"building it with {opts!r}", source_cls, opts)
    if not ok:
        return
    _check_describe(record, source, "before splits()")
    ok, parts = attempt(f"splits({seed})", source.splits, seed)
    if not ok:
        return
    texts = _check_splits(record, parts, seed)
    _check_describe(record, source, "after splits()")

    again = _run(record, f"splits({seed}) called again", source.splits, seed)
    texts_again = _check_splits(record, again, seed)
    for split in SPLITS:
        _expect(
            texts_again[split] == texts[split],
            record,
            f"splits({seed}) is not deterministic: the {split} split differs between two calls "
            "with the same seed (cached token files would not match the data)",
        )
    fresh = _run(record, f"building it again with {opts!r}", source_cls, opts)
    texts_fresh = _check_splits(record, _run(record, f"splits({seed})", fresh.splits, seed), seed)
    for split in SPLITS:
        _expect(
            texts_fresh[split] == texts[split],
            record,
            f"splits({seed}) is not deterministic: the {split} split differs between two "
            "sources built from the same options with the same seed",
        )

    train, val = texts["train"], texts["validation"]
    if len(train) + len(val) > 1:
        seen = set(train)
        _expect(
            any(t not in seen for t in val),
            record,
            f"splits({seed}): the validation split is a copy of train's rows (every validation "
            "document is also in train); hold documents out",
        )
    _check_fingerprint(record, source)


def _check_splits(record: Record, parts: Any, seed: int) -> dict[str, list[str]]:
    """The text column of each split, after checking the splits' shape."""
    what = f"splits({seed})"
    _expect(
        hasattr(parts, "keys") and hasattr(parts, "__getitem__"),
        record,
        f"{what} returned {type(parts).__name__}, not a datasets.DatasetDict",
    )
    have = ", ".join(map(str, parts.keys())) or "none"
    for split in SPLITS:
        _expect(split in parts, record, f"{what} has no {split!r} split (splits: {have})")
    _expect(
        parts["train"] is not parts["validation"],
        record,
        f"{what}: the train and validation splits are the same dataset",
    )
    out: dict[str, list[str]] = {}
    for split in SPLITS:
        ds = parts[split]
        columns = list(getattr(ds, "column_names", None) or [])
        _expect(
            "text" in columns,
            record,
            f"{what}: the {split} split has no 'text' column (columns: {', '.join(columns)})",
        )
        feature = getattr(ds, "features", {}).get("text")
        dtype = getattr(feature, "dtype", None)
        _expect(
            dtype in ("string", "large_string"),
            record,
            f"{what}: the {split} split's 'text' column holds {feature}, not strings",
        )
        texts = list(ds["text"])
        bad = next((t for t in texts if not isinstance(t, str)), "")
        _expect(
            isinstance(bad, str),
            record,
            f"{what}: the {split} split's 'text' column holds {type(bad).__name__} "
            f"{bad!r}, not strings",
        )
        _expect(bool(texts), record, f"{what}: the {split} split has no documents")
        out[split] = texts
    return out


def _check_describe(record: Record, source: Any, when: str) -> None:
    text = _run(record, f"describe() {when}", source.describe)
    _expect(
        isinstance(text, str),
        record,
        f"describe() {when} returned {type(text).__name__}, not a str",
    )
    _expect(bool(text.strip()), record, f"describe() {when} returned an empty string")
    _expect(
        len(text.splitlines()) == 1 and not text.endswith(("\n", "\r")),
        record,
        f"describe() {when} is not one line: {text!r}",
    )


def _check_fingerprint(record: Record, source: Any) -> None:
    fingerprint = getattr(source, "fingerprint", None)
    if fingerprint is None:
        return
    _expect(callable(fingerprint), record, "fingerprint is defined but not callable")
    first = _run(record, "fingerprint()", fingerprint)
    _expect(
        isinstance(first, str),
        record,
        f"fingerprint() returned {type(first).__name__}, not a str",
    )
    second = _run(record, "fingerprint() called again", fingerprint)
    _expect(
        second == first,
        record,
        f"fingerprint() is not stable: {first!r}, then {second!r} with the same input "
        "(cached token files would never be reused)",
    )
