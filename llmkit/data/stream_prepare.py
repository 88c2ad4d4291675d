"""``data.streaming``: what a run prepares for a streamed source before step 1 — its
tokenizer (trained on the start of the training files when none is given) and its
validation split, a small token file; the training files are only read by the
:class:`~llmkit.data.streaming.StreamSampler` while training."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmkit.data.stream_readers import read_pieces, split_held_out
from llmkit.data.streaming import HELD_OUT_MAX_BYTES, validation_ids
from llmkit.data.tokenizer import Tokenizer, build_tokenizer
from llmkit.data.tokens import FORMAT_VERSION, TokenFile, _reusable, token_dtype, write_token_file
from llmkit.errors import LlmkitError

if TYPE_CHECKING:
    from llmkit.spec import ResolvedSpec


def stream_inputs(rs: ResolvedSpec, source: Any) -> dict[str, Any]:
    """The streamed source's files and settings (:meth:`FileSource.stream_inputs`)."""
    get = getattr(source, "stream_inputs", None)
    inputs = get() if callable(get) else None
    if inputs is None:
        name = rs.dataset.name if rs.dataset is not None else "?"
        raise LlmkitError(
            f"data.streaming: the source {name!r} cannot be streamed (the jsonl, parquet and "
            "text sources can)"
        )
    if rs.spec.data.sampling != "packed":
        raise LlmkitError(
            f"data.streaming: data.sampling = {rs.spec.data.sampling!r}; a stream gives "
            "packed rows only"
        )
    if inputs["validation"] is None and not inputs["val_fraction"] > 0:
        raise LlmkitError("data.streaming: give val_paths or a val_fraction > 0 for validation")
    return inputs


def held_out(inputs: dict[str, Any]) -> float:
    """The share of the training files held out for validation (0 with val_paths)."""
    return 0.0 if inputs["validation"] is not None else float(inputs["val_fraction"])


def training_texts(inputs: dict[str, Any]) -> Iterator[str]:
    """The training part of the files' texts in file order (for a tokenizer's sample)."""
    paths = [Path(p) for p in inputs["train"]]
    fmt = inputs["format"]
    ranges = split_held_out(paths, fmt, held_out(inputs), HELD_OUT_MAX_BYTES)[0]
    for r in ranges:
        for text, *_ in read_pieces(paths[r.file], fmt, r, r.start, inputs["text_field"]):
            yield text


def prepare_stream(
    rs: ResolvedSpec,
    source: Any,
    run_dir: Path,
    tokenizer: Tokenizer | None,
    cache_dir: Path,
    log: Callable[[str], None],
) -> tuple[Tokenizer, TokenFile, dict[str, Any], str]:
    """The tokenizer, the validation token file, the stream's inputs and a description."""
    inputs = stream_inputs(rs, source)
    spec = rs.spec
    if tokenizer is None:
        tokenizer = build_tokenizer(
            spec.tokenizer,
            lambda: training_texts(inputs),
            run_dir / "tokenizer.json",
            spec.model.vocab_size,
            log=log,
            source=rs.source,
        )
    key = hashlib.sha256(
        json.dumps(
            {
                "format": FORMAT_VERSION,
                "stream": {k: v for k, v in inputs.items()},
                "files": source.fingerprint(),
                "tokenizer": hashlib.sha256(tokenizer.to_str().encode()).hexdigest(),
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:12]
    path = cache_dir / f"validation-stream-{key}.bin"
    n_train = len(inputs["train"])
    what = f"stream of {n_train} {inputs['format']} file(s)" + (
        f", validation {len(inputs['validation'])} file(s)"
        if inputs["validation"] is not None
        else f", validation the last {inputs['val_fraction']:g} (at most 8 MiB)"
    )
    if _reusable(path):
        val = TokenFile(path)
        log(f"data: {what}; validation: {len(val):,} tokens (cached {path.name})")
        return tokenizer, val, inputs, what
    if inputs["validation"] is not None:
        ids = validation_ids(
            inputs["validation"],
            fmt=inputs["format"],
            tokenizer=tokenizer,
            text_field=inputs["text_field"],
        )
    else:
        ids = validation_ids(
            inputs["train"],
            fmt=inputs["format"],
            tokenizer=tokenizer,
            text_field=inputs["text_field"],
            held_out=held_out(inputs),
        )
    if len(ids) == 0:
        raise LlmkitError(f"data.streaming: {what}: the validation split has no text")
    meta = {"key": key, "source": what, "eos_id": tokenizer.eos_id}
    val = write_token_file([np.asarray(ids)], path, token_dtype(tokenizer.vocab_size), meta)
    log(f"data: {what}; validation: {len(val):,} tokens -> {path}")
    return tokenizer, val, inputs, what
