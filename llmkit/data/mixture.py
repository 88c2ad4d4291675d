"""Weighted mixtures of sources (``data.mixture``): each source tokenized and cached on its
own, one tokenizer for all, and a sampler that fills every batch's rows from the sources in
proportion to their weights.

Rows are dealt by largest deficit (the source furthest below its share of the rows drawn
so far takes the next row), so the realised shares never differ from the weights by more
than one row in any prefix of the run: deterministic, the same on every rank, and needing
only a count per source to resume exactly. Weights may change on resume (a curriculum):
the new shares count from the resume on, and the change is said once."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmkit.data.store import DataStore, recipe_key
from llmkit.data.tokenizer import Tokenizer, build_tokenizer
from llmkit.data.tokens import TokenFile
from llmkit.errors import LlmkitError

if TYPE_CHECKING:
    import torch

    from llmkit.spec import ResolvedSpec


@dataclass
class DataPart:
    """One prepared source of a mixture."""

    name: str
    weight: float  # normalised: the parts' weights sum to 1
    train: TokenFile | None  # None: streamed (``stream``)
    validation: TokenFile
    description: str
    stream: dict[str, Any] | None = None


def normalised(weights: Iterable[float]) -> list[float]:
    """``weights`` scaled to sum to 1."""
    ws = [float(w) for w in weights]
    total = math.fsum(ws)
    if not ws or total <= 0 or not all(w > 0 and math.isfinite(w) for w in ws):
        raise LlmkitError(f"data.mixture: weights must be positive and finite, got {ws}")
    return [w / total for w in ws]


# -- preparing -------------------------------------------------------------------------------


def prepare_mixture(
    rs: ResolvedSpec,
    run_dir: Path,
    tokenizer: Tokenizer | None,
    log: Callable[[str], None],
    prepare_one: Callable[..., Any],
) -> tuple[Tokenizer, list[DataPart]]:
    """The mixture's tokenizer (given, the run's, ``tokenizer.path``, or trained on a sample
    of every source in proportion to the weights) and each source prepared by
    ``prepare_one(rs_of_that_source, run_dir, tokenizer, log=...)`` (:func:`prepare_data`)."""
    weights = normalised(p.weight for p in rs.mixture)
    sources = [p.source.build(p.source.options) for p in rs.mixture]
    for part, source in zip(rs.mixture, sources, strict=True):
        chat_format = getattr(source, "chat_format", None)
        if callable(chat_format) and chat_format() is not None:
            raise LlmkitError(
                f"data.mixture: {part.name!r} is a chat source; a mixture takes text sources "
                "(train chat data on its own, or fine-tune a mixture-trained run on it)"
            )
    if tokenizer is None:
        tokenizer = _mixture_tokenizer(rs, run_dir, sources, weights, log)
    parts: list[DataPart] = []
    for part, weight in zip(rs.mixture, weights, strict=True):

        def said(line: str, name: str = part.name) -> None:
            log(line.replace("data: ", f"data[{name}]: ", 1))

        one = prepare_one(rs.with_source(part.source), run_dir, tokenizer, log=said)
        parts.append(
            DataPart(
                part.name, weight, one.train, one.validation, one.source_description, one.stream
            )
        )
    shares = ", ".join(
        f"{p.name} {p.weight:.1%} of "
        + ("a stream" if p.train is None else f"{len(p.train):,} tokens")
        for p in parts
    )
    log(f"data: mixture of {len(parts)} sources: {shares}")
    return tokenizer, parts


def _mixture_tokenizer(
    rs: ResolvedSpec,
    run_dir: Path,
    sources: list[Any],
    weights: list[float],
    log: Callable[[str], None],
) -> Tokenizer:
    """The run's tokenizer for a mixture: trained on texts drawn from every source by weight
    (in bytes), shared across runs through the data store as a single source's is."""
    from llmkit.data.prepare import iter_texts

    spec = rs.spec
    seed = spec.train.seed if spec.data.seed is None else spec.data.seed
    out = run_dir / "tokenizer.json"

    def texts() -> Iterator[str]:
        streams = [_texts(s) for s in sources]
        return interleave_by_bytes(streams, weights)

    def _texts(source: Any) -> Iterator[str]:
        inputs = getattr(source, "stream_inputs", None)
        if spec.data.streaming and callable(inputs) and inputs() is not None:
            from llmkit.data.stream_prepare import training_texts

            return training_texts(inputs())  # a streamed source is never loaded whole
        return iter_texts(source.splits(seed)["train"], seed)

    prints = [getattr(s, "fingerprint", None) for s in sources]
    files = [f() if callable(f) else None for f in prints]
    store = DataStore() if spec.data.shared_cache and None not in files else None
    if store is None or spec.tokenizer.path or out.exists():
        return build_tokenizer(
            spec.tokenizer, texts, out, spec.model.vocab_size, log=log, source=rs.source
        )
    options = {"mixture": [[p.name, p.source.to_dict(), w] for p, w in zip(rs.mixture, weights)]}
    files_key = hashlib.sha256(json.dumps(files).encode()).hexdigest()
    tok_dict = spec.tokenizer.model_dump(mode="json")
    recipe = recipe_key(options, seed, files_key, tok_dict, spec.model.vocab_size)
    kept = store.tokenizer(recipe)
    if kept is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(kept, out)
    tokenizer = build_tokenizer(
        spec.tokenizer,
        texts,
        out,
        spec.model.vocab_size,
        log=log if kept is None else None,
        source=rs.source,
    )
    if kept is None:
        try:
            store.keep_tokenizer(recipe, out)
        except OSError as exc:
            log(f"data: not kept in the shared cache ({exc})")
    else:
        log(
            f"tokenizer: {tokenizer.kind}, {tokenizer.vocab_size} tokens, trained by an earlier run"
        )
    return tokenizer


def interleave_by_bytes(streams: list[Iterator[str]], weights: list[float]) -> Iterator[str]:
    """Texts from ``streams``, each next text taken from the stream furthest below its
    weight's share of the bytes so far; an exhausted stream drops out."""
    taken = [0] * len(streams)
    live = list(range(len(streams)))
    while live:
        total = sum(taken[i] for i in live) + 1
        i = max(live, key=lambda j: weights[j] * total - taken[j])
        text = next(streams[i], None)
        if text is None:
            live.remove(i)
            continue
        taken[i] += len(text.encode("utf-8", "surrogatepass")) + 1
        yield text


# -- sampling --------------------------------------------------------------------------------


def deal_rows(weights: list[float], taken: list[int], n: int) -> list[int]:
    """How many of the next ``n`` rows each source takes, by largest deficit against
    ``weights`` given the rows ``taken`` so far (updated in place). Ties go to the earlier
    source, so every rank deals alike."""
    counts = [0] * len(weights)
    for _ in range(n):
        total = sum(taken) + 1
        i = max(range(len(weights)), key=lambda j: (weights[j] * total - taken[j], -j))
        taken[i] += 1
        counts[i] += 1
    return counts


class MixtureSampler:
    """Batches whose rows come from each source's own sampler (packed, random or padded, as
    ``data.sampling`` says) in proportion to the weights. State: each source's sampler
    state, its rows since the weights were set, and its rows over the run."""

    def __init__(self, names: list[str], weights: list[float], samplers: list[Any]) -> None:
        if not (len(names) == len(weights) == len(samplers)) or not names:
            raise ValueError("a mixture needs one weight and one sampler per source")
        self.names = list(names)
        self.weights = normalised(weights)
        self.samplers = list(samplers)
        self.taken = [0] * len(names)  # rows since these weights were set (dealing)
        self.rows = [0] * len(names)  # rows over the whole run (reporting)
        self.change: str | None = None  # said once when resumed with other weights

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        import torch

        counts = deal_rows(self.weights, self.taken, batch_size)
        pieces = []
        for i, n in enumerate(counts):
            if n:
                pieces.append(self.samplers[i].next_batch(n))
                self.rows[i] += n
        if len(pieces) == 1:
            return pieces[0]
        return tuple(torch.cat(parts) for parts in zip(*pieces, strict=True))

    def shares(self) -> dict[str, float]:
        """Each source's share of the rows (= tokens) drawn over the run."""
        total = sum(self.rows)
        return {n: (r / total if total else 0.0) for n, r in zip(self.names, self.rows)}

    def describe_shares(self, block_size: int, train_tokens: list[int | None]) -> str:
        """``web 70.0 % (weight 70.0 %, 1.93 passes), …`` over the run."""
        shares = self.shares()
        items = []
        for name, weight, rows, n in zip(
            self.names, self.weights, self.rows, train_tokens, strict=True
        ):
            passes = "" if n is None else f", {rows * block_size / max(n, 1):.2f} passes"
            items.append(f"{name} {shares[name]:.1%} (weight {weight:.1%}{passes})")
        return ", ".join(items)

    def state_dict(self) -> dict[str, Any]:
        return {
            "mixture": {
                name: {
                    "weight": w,
                    "taken": taken,
                    "rows": rows,
                    "sampler": sampler.state_dict(),
                }
                for name, w, taken, rows, sampler in zip(
                    self.names, self.weights, self.taken, self.rows, self.samplers, strict=True
                )
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("mixture") if isinstance(state, dict) else None
        if not isinstance(saved, dict):
            raise LlmkitError(
                "resume: the checkpoint's data position is not a mixture's; a run started on "
                "one source cannot resume as a mixture"
            )
        if set(saved) != set(self.names):
            raise LlmkitError(
                f"resume: the mixture's sources changed (checkpoint: {', '.join(saved)}; spec: "
                f"{', '.join(self.names)}); only their weights may change on resume"
            )
        try:
            old = [float(saved[n]["weight"]) for n in self.names]
            taken = [int(saved[n]["taken"]) for n in self.names]
            rows = [int(saved[n]["rows"]) for n in self.names]
        except (KeyError, TypeError, ValueError) as exc:
            raise LlmkitError(f"resume: bad mixture state in the checkpoint ({exc})") from exc
        for name, sampler in zip(self.names, self.samplers, strict=True):
            sampler.load_state_dict(saved[name]["sampler"])
        self.rows = rows
        if all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(old, self.weights)):
            self.taken = taken
            return
        self.taken = [0] * len(self.names)  # the new shares count from here
        moves = ", ".join(
            f"{n} {a:.1%} → {b:.1%}" for n, a, b in zip(self.names, old, self.weights, strict=True)
        )
        self.change = f"data: mixture weights changed on resume (a curriculum): {moves}"
