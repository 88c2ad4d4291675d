"""The ``data`` group: ``llmkit data prepare``, a sharded token store from a spec's
``data.source`` or from text files (:mod:`llmkit.data.shards_prepare`)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from llmkit.cli.common import add_set, at_least, console, human, positive_float

SPEC_SUFFIXES = (".toml", ".yaml", ".yml")


def register_commands(register: Callable[..., Any]) -> None:
    register("data", help="data preparation: `llmkit data prepare SPEC|FILES --out DIR`")
    register(
        "prepare",
        run_prepare,
        group="data",
        help="tokenize a corpus into a directory of token shards, in parallel, resumably",
        description="Tokenize a spec's data.source (with its tokenizer.path, or a tokenizer "
        "trained as a run trains it) or text files (.jsonl/.parquet/.txt, with --tokenizer) "
        "into DIR: fixed-size shards of token ids with an index (dtype, tokenizer hash, "
        "tokens and documents per shard, document ends, SHA-256). Run it again after a crash "
        "to go on where it stopped. A spec trains from it with [data.source] name = "
        '"tokens", path = "DIR".',
        configure=configure_prepare,
    )


def configure_prepare(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs", nargs="+", metavar="SPEC|FILE", help="a spec file, or text files/globs"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the store's directory")
    p.add_argument(
        "--workers",
        type=at_least(1),
        metavar="N",
        default=None,
        help="tokenizing processes (default: the CPU cores)",
    )
    p.add_argument(
        "--shard-tokens",
        type=at_least(1),
        default=100_000_000,
        metavar="N",
        help="tokens per shard (default 100M, as FineWeb's llm.c shards)",
    )
    p.add_argument(
        "--format",
        choices=("llmkit", "llmc"),
        default="llmkit",
        help="llmkit: bare ids; llmc: llm.c .bin files (1024-byte header), which llm.c and "
        "nanoGPT-style trainers read as they are",
    )
    p.add_argument("--tokenizer", metavar="JSON", help="files: the tokenizer.json to use")
    p.add_argument(
        "--vocab-size",
        type=at_least(257),
        metavar="N",
        help="files: train a byte-level BPE of N ids on them",
    )
    p.add_argument("--text-field", help="files: the field holding the text (default text)")
    p.add_argument(
        "--val-fraction", type=positive_float("a fraction"), help="files: share held out"
    )
    p.add_argument("--val", nargs="+", metavar="FILE", help="files: the validation files")
    p.add_argument("--seed", type=at_least(0), default=0, help="files: the split's seed")
    add_set(p, help="spec: dotted override")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar (default: on a terminal; plain lines otherwise)",
    )


def run_prepare(args: argparse.Namespace) -> int:
    from llmkit.data.shards_prepare import prepare_files, prepare_spec
    from llmkit.errors import LlmkitError

    workers = args.workers or os.cpu_count() or 1
    is_spec = len(args.inputs) == 1 and args.inputs[0].lower().endswith(SPEC_SUFFIXES)
    say = _Reporter(args.progress)
    common = {
        "workers": workers,
        "shard_tokens": args.shard_tokens,
        "layout": args.format,
        "progress": say.progress,
        "log": say.log,
    }
    start = time.perf_counter()
    try:
        if is_spec:
            from llmkit.cli.common import load

            if args.tokenizer or args.vocab_size or args.val or args.text_field:
                raise LlmkitError("a spec names its own tokenizer and files; drop the file options")
            index = prepare_spec(load(args.inputs[0], args.set), args.out, **common)
        else:
            if args.set:
                raise LlmkitError("--set is for a spec; give a spec file")
            index = prepare_files(
                args.inputs,
                args.out,
                tokenizer=args.tokenizer,
                vocab_size=args.vocab_size,
                val_paths=args.val,
                text_field=args.text_field,
                val_fraction=args.val_fraction,
                seed=args.seed,
                **common,
            )
    finally:
        say.close()
    seconds = time.perf_counter() - start
    console().print(summary(index, args.out, say.tokenized(), seconds, workers), markup=False)
    return 0


def summary(index: dict[str, Any], out: str, text: int, seconds: float, workers: int) -> str:
    """``prepared DIR: train 1.2M tokens (N documents) in 3 shard(s), validation ...; uint16
    ids, tokenizer sha256 …; 12.3 MB of text tokenized in 4.2 s (2.9 MB/s, 2 workers)``."""
    parts = []
    for split, part in index["splits"].items():
        parts.append(
            f"{split} {human(part['tokens'])} tokens ({part['documents']:,} documents) in "
            f"{len(part['shards'])} shard(s)"
        )
    if text:
        rate = (
            f"{text / 1e6:.1f} MB of text tokenized in {seconds:.1f} s "
            f"({text / 1e6 / max(seconds, 1e-9):.2f} MB/s, {workers} worker(s))"
        )
    else:
        rate = "complete already: every shard checked"
    tok = index["tokenizer"]
    return (
        f"prepared {out}: {', '.join(parts)}; {index['dtype']} ids, tokenizer sha256 "
        f"{tok['sha256'][:12]}; {rate}"
    )


class _Reporter:
    """Progress: a rich bar on a terminal, else a plain line at most every 10 seconds."""

    EVERY_S = 10.0

    def __init__(self, enabled: bool | None) -> None:
        self.bar_on = sys.stderr.isatty() if enabled is None else enabled
        self.bar: Any = None
        self.task: Any = None
        self.split: str | None = None
        self.last = 0.0
        self.t0 = time.perf_counter()
        self.done: dict[str, int] = {}

    def log(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line, markup=False)
        else:
            console(stderr=True).print(line, markup=False)

    def tokenized(self) -> int:
        """Text bytes tokenized by this run."""
        return sum(self.done.values())

    def progress(self, p: Any) -> None:
        self.done[p.split] = p.text_bytes
        if self.bar_on:
            self._draw(p)
            return
        now = time.perf_counter()
        if now - self.last < self.EVERY_S and p.split == self.split:
            return
        self.last, self.split = now, p.split
        of = f" of {p.total:,}" if p.total else ""
        mb = p.text_bytes / 1e6
        self.log(
            f"data prepare: {p.split}: {p.documents:,}{of} documents, {p.tokens:,} tokens, "
            f"{p.shards} shard(s) written, {mb / max(now - self.t0, 1e-9):.2f} MB/s"
            + (" (skipping what an earlier run did)" if p.resumed else "")
        )

    def _draw(self, p: Any) -> None:
        if self.bar is None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=console(stderr=True),
            )
            self.bar.start()
        if p.split != self.split:
            self.split = p.split
            self.task = self.bar.add_task(f"{p.split}", total=p.total, info="")
        info = f"{p.tokens:,} tokens, {p.shards} shard(s)" + (" (resuming)" if p.resumed else "")
        self.bar.update(self.task, completed=p.documents, total=p.total, info=info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
