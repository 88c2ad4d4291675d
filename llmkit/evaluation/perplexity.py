"""Loss and perplexity, per token and per byte.

The loss is the training objective (:class:`~llmkit.model.objective.Objective`): the
model's cross-entropy, or the spec's ``loss`` component evaluated exactly as a training step
computes it. Perplexity and the per-byte figures always come from the cross-entropy, so they
compare across objectives and tokenizers.

The batch-level functions (:func:`evaluate_batches`, :func:`sliding_batches`) are what the
trainer's validation uses; :func:`run_perplexity` evaluates a saved run on its validation
split or a text file (``llmkit eval``). Evaluating a run only reads it: its validation split
is prepared in a scratch directory (reusing the run's token files, or the shared data store's,
where they are), never in the run directory, and a run that never trained on its spec's data
(an imported checkpoint) has no validation split (:func:`no_data_of_its_own`).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from llmkit.errors import LlmkitError
from llmkit.model import Transformer
from llmkit.model.objective import Objective


@dataclass
class EvalResult:
    """Token-weighted means: ``loss`` is the objective; ``cross_entropy`` is set when the
    objective is another loss than the model's cross-entropy."""

    loss: float  # mean objective per predicted token (nats for cross-entropy)
    tokens: int
    text_bytes: int | None = None
    cross_entropy: float | None = None
    words: int | None = None  # whitespace-separated words of the text, when known

    @property
    def ce(self) -> float:
        """Mean cross-entropy per predicted token (nats)."""
        return self.loss if self.cross_entropy is None else self.cross_entropy

    @property
    def ppl(self) -> float:
        return math.exp(min(self.ce, 80.0))

    @property
    def nats_per_byte(self) -> float | None:
        if not self.text_bytes:
            return None
        return self.ce * self.tokens / self.text_bytes

    @property
    def bits_per_byte(self) -> float | None:
        npb = self.nats_per_byte
        return None if npb is None else npb / math.log(2)

    @property
    def word_perplexity(self) -> float | None:
        """exp(cross-entropy summed over the text / its words): compares across tokenizers."""
        if not self.words:
            return None
        return math.exp(min(self.ce * self.tokens / self.words, 80.0))

    def as_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {
            "loss": self.loss,
            "ppl": self.ppl,
            "tokens": self.tokens,
            "bytes": self.text_bytes,
            "bits_per_byte": self.bits_per_byte,
        }
        if self.words:
            out["words"] = self.words
            out["word_perplexity"] = self.word_perplexity
        if self.cross_entropy is not None:
            out["cross_entropy"] = self.cross_entropy
        return out


@torch.no_grad()
def evaluate_batches(
    model: Transformer,
    batches: Iterable[tuple[Tensor, Tensor]],
    device: torch.device,
    amp: AbstractContextManager | None = None,
    objective: Objective | None = None,
) -> EvalResult:
    """Token-weighted mean of ``objective`` (default: the model's cross-entropy) over
    ``batches``, and of the cross-entropy beside another objective; targets of -100 are not
    counted. The model is left in the mode it was in."""
    objective = objective or Objective()
    objective.to(device)
    was_training = model.training
    model.eval()
    total, total_ce, count = 0.0, 0.0, 0
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with amp or nullcontext():
                out = objective(model, x, y, cross_entropy=True)
            n = int((y != -100).sum())
            total += float(out.loss) * n
            if out.cross_entropy is not None and not objective.is_cross_entropy:
                total_ce += float(out.cross_entropy) * n
            count += n
    finally:
        model.train(was_training)
    ce = None if objective.is_cross_entropy else total_ce / max(count, 1)
    return EvalResult(total / max(count, 1), count, cross_entropy=ce)


def full_text_batches(
    tokens: Tensor, block_size: int, batch_size: int
) -> Iterable[tuple[Tensor, Tensor]]:
    """Every token of a sequence but the first, each scored once, in windows of
    ``block_size`` that do not overlap but the last (it reaches back for a full context),
    so per-byte figures cover the whole text."""
    return sliding_batches(tokens, block_size, block_size, batch_size)


def sliding_windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows that score tokens 1..n-1 of an n-token sequence, each once: ``(start,
    end, first)`` feeds tokens ``start:end`` (at most ``context``) and scores the
    predictions of tokens ``first+1..end``. Each window moves the end by ``stride`` tokens,
    so every token after the first window is predicted from at least ``context - stride``
    tokens before it (the sliding-window perplexity WikiText numbers are reported with;
    ``stride = context`` gives disjoint windows). The last window reaches back for a full
    context, as lm-eval-harness's rolling windows do."""
    if context < 1 or not 1 <= stride <= context:
        raise ValueError(f"need 1 ≤ stride ≤ context, got stride {stride}, context {context}")
    out: list[tuple[int, int, int]] = []
    done = 0  # tokens 1..done are scored
    while done < n - 1:
        end = min(done + stride, n - 1) if out else min(context, n - 1)
        start = max(0, end - context)
        out.append((start, end, done))
        done = end
    return out


def sliding_batches(
    tokens: Tensor, context: int, stride: int, batch_size: int
) -> Iterable[tuple[Tensor, Tensor]]:
    """Batches of :func:`sliding_windows` over ``tokens`` (1-D, any integer dtype): int64
    inputs (B, context) and targets with -100 wherever a token is padding or was scored by
    an earlier window."""
    windows = sliding_windows(tokens.numel(), context, stride)
    for i in range(0, len(windows), batch_size):
        part = windows[i : i + batch_size]
        # int64 batches from any integer tokens (a long text's are kept as int32)
        x = torch.zeros((len(part), context), dtype=torch.long, device=tokens.device)
        y = torch.full((len(part), context), -100, dtype=torch.long, device=tokens.device)
        for b, (start, end, first) in enumerate(part):
            x[b, : end - start] = tokens[start:end]
            y[b, first - start : end - start] = tokens[first + 1 : end + 1]
        yield x, y


@dataclass
class EvalText:
    """What a run is evaluated on: a 1-D token tensor (text, scored in sliding windows) or a
    prepared split whose rows are scored as trained (masked or padded rows); the text's size
    in bytes and words where per-byte and per-word figures mean something; where it came from.
    A split prepared in a scratch directory keeps it until :meth:`close` (or until the object
    is collected)."""

    tokens: Any
    text_bytes: int | None
    words: int | None
    source: str
    scratch: Path | None = None

    def __post_init__(self) -> None:
        self._cleanup = None
        if self.scratch is not None:
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.scratch, True)

    @property
    def is_text(self) -> bool:
        return isinstance(self.tokens, Tensor)

    def close(self) -> None:
        """Remove the scratch directory the split was prepared in, if any."""
        if self._cleanup is not None:
            self._cleanup()


#: The file ``llmkit import-hf`` writes into an imported run (:mod:`llmkit.interop.runs`).
IMPORTED_MARKER = "hf_source.json"


def no_data_of_its_own(run_dir: Path, rs: Any) -> str | None:
    """Why the run at ``run_dir`` (its resolved spec ``rs``) has no validation split of its
    own, or None when it has one. A spec whose ``data.source`` is the built-in default corpus
    (what a spec without a data section gets) names the run's own data only if the run
    trained on it: an imported checkpoint (``hf_source.json``) never did; another run did if
    it has token files (``data/``), checkpoints or a training record in ``metrics.jsonl``."""
    from llmkit.registry import get_registry

    kind = get_registry().kinds.get("dataset")
    default = getattr(kind, "default", None)
    if rs.dataset is None or default is None or rs.dataset.name != default:
        return None  # a corpus the spec chose
    why = f"its spec's data is the built-in default ({default}), not data it learnt from"
    if (run_dir / IMPORTED_MARKER).is_file():
        return f"was imported (llmkit import-hf); {why}"
    if (run_dir / "data").is_dir() or (run_dir / "checkpoints").is_dir():
        return None
    from llmkit.runs import METRICS_FILE
    from llmkit.runs.metrics import MetricsLog

    if any("eval" not in r for r in MetricsLog(run_dir / METRICS_FILE).read()):
        return None  # trained (task results are logged as records with "eval")
    return f"never trained; {why}"


def no_data_message(run_dir: Path, reason: str) -> str:
    return (
        f"{run_dir} {reason}, so it has no validation split of its own: give --data FILE "
        "(a text file) or --task"
    )


def validation_text(run: Any) -> EvalText:
    """The run's validation split: its tokens as text when it is packed and every token is
    trained, else the split itself (chat data trains only the assistant's tokens; padded rows
    have bytes that mean nothing per token).

    Nothing is written into the run: the split is prepared in a scratch directory that
    reuses the run's own token files (linked, read-only) or the shared data store's, and
    tokenizes the corpus only when neither has them. A run without data of its own
    (:func:`no_data_of_its_own`) is an error."""
    from llmkit.data import prepare_data

    reason = no_data_of_its_own(run.run_dir, run.spec)
    if reason is not None:
        raise LlmkitError(no_data_message(run.run_dir, reason))
    spec = run.spec.spec
    own = Path(spec.data.cache_dir).expanduser() if spec.data.cache_dir else run.run_dir / "data"
    scratch = Path(tempfile.mkdtemp(prefix="llmkit-eval-"))
    try:
        data = scratch / "data"
        data.mkdir()
        _link_files(own, data)
        rs = run.spec.with_settings({"data.cache_dir": str(data)})
        prepared = prepare_data(rs, scratch, run.tokenizer, log=lambda _m: None)
        if prepared.parts:  # a mixture: every source's validation split, one after another
            vals = [p.validation for p in prepared.parts]
            ids = torch.cat([torch.from_numpy(np.asarray(v.array).astype("int32")) for v in vals])
            counted = [v.n_bytes_text for v in vals]
            n_bytes = None if None in counted else sum(counted)
            names = ", ".join(p.name for p in prepared.parts)
            what = f"validation splits of the mixture ({names}), concatenated"
            shutil.rmtree(scratch, ignore_errors=True)
            return EvalText(ids, n_bytes, None, what)
        val = prepared.validation
        if val.has_mask or val.layout != "packed":  # read later: the scratch stays till then
            return EvalText(val, None, None, "validation split (trained tokens)", scratch)
        tokens = torch.from_numpy(val.array.astype("int32"))  # batches are int64
        text = EvalText(tokens, val.n_bytes_text, None, "validation split")
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    shutil.rmtree(scratch, ignore_errors=True)
    return text


def _link_files(src: Path, dst: Path) -> None:
    """Each file of ``src`` (if it exists) as a symbolic link in ``dst``, else a hard link;
    a file that can be neither is left out (prepared again if needed). Token files are
    replaced by renaming, never written through, so the originals are only read."""
    if not src.is_dir():
        return
    for f in src.iterdir():
        if not f.is_file():
            continue
        try:
            (dst / f.name).symlink_to(f.resolve())
        except OSError:
            try:
                os.link(f, dst / f.name)
            except OSError:
                continue


def file_text(run: Any, path: Path, what: str = "--data") -> EvalText:
    """A UTF-8 text file in the run's tokenizer; errors name the file as ``what``, and
    characters the tokenizer does not know are logged as a note. Any size is read in
    bounded memory beside the text: encoded in pieces (:func:`~llmkit.data.long_text.encode_long`)
    into int32 ids, its bytes and words counted piece by piece."""
    from llmkit.data.long_text import encode_long
    from llmkit.files import read_utf8

    if path.is_dir():
        raise LlmkitError(f"{what}: {path} is a directory; expected a text file")
    if not path.is_file():
        raise LlmkitError(f"{what}: file not found: {path}")
    text = read_utf8(path)
    if not text:
        raise LlmkitError(f"{what}: {path} is empty")
    ids = encode_long(run.tokenizer, text)
    note = run.tokenizer.unknown_note(ids, str(path))
    if note:
        logging.getLogger("llmkit").info(f"{what}: {note}")
    if ids.size < 2:
        raise LlmkitError(f"{what}: {path} has fewer than 2 tokens")
    n_bytes, words = text_size(text)
    return EvalText(torch.from_numpy(ids), n_bytes, words, str(path))


def text_size(text: str, piece: int = 1 << 20) -> tuple[int, int]:
    """UTF-8 bytes and whitespace-separated words of ``text`` (``len(text.split())``),
    counted ``piece`` characters at a time, never a list of all its words."""
    n_bytes = words = 0
    joined = False  # whether the last piece ended inside a word
    for start in range(0, len(text), piece):
        part = text[start : start + piece]
        n_bytes += len(part) if part.isascii() else len(part.encode("utf-8", "surrogatepass"))
        words += len(part.split()) - (joined and not part[0].isspace())
        joined = not part[-1].isspace()
    return n_bytes, words


def run_perplexity(
    run: Any,
    text: EvalText,
    model: nn.Module | None = None,
    *,
    context: int,
    stride: int,
    batch_size: int,
    device: torch.device,
) -> EvalResult:
    """The run's objective and perplexity on ``text`` (``model``: the run's own by default,
    or a converted copy of it): text in windows of ``context`` tokens moving by ``stride``,
    a prepared split row by row, each trained token once."""
    from llmkit.data import eval_batches, eval_rows

    objective = Objective.from_spec(run.spec)  # what the run trained on (its val_loss)
    if text.is_text:
        batches = sliding_batches(text.tokens, context, stride, batch_size)
    else:
        block = run.spec.spec.data.block_size or run.spec.model.max_seq_len
        rows = len(eval_rows(text.tokens, block))
        batches = eval_batches(text.tokens, block, batch_size, -(-rows // batch_size))
    res = evaluate_batches(model or run.model, batches, device, objective=objective)
    res.text_bytes, res.words = text.text_bytes, text.words
    return res
