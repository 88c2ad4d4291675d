"""What generation refuses before it starts, each in one line: text that is not valid
Unicode (the lone surrogates Python makes of bytes that are not UTF-8), weights that hold
NaN or infinity (checked a chunk at a time: no copy of the model), and a batch whose
decoding state cannot fit in the memory left (estimated from the shapes before anything
is allocated)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmkit.errors import LlmkitError
from llmkit.model.finite import first_nonfinite


class GenerationError(LlmkitError, ValueError):
    """A generation setting, prompt or model that cannot work: a ``ValueError`` to the
    Python API, one line (``error: …``, exit 2) from the CLI, as an :class:`LlmkitError`."""


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8, or None: the first lone surrogate, read back
    as the byte it escapes when it came from bytes that are not UTF-8 (the command line or a
    file read with ``errors="surrogateescape"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        if 0xDC80 <= code <= 0xDCFF:
            return f"not valid UTF-8 (byte 0x{code - 0xDC00:02x} at character {exc.start})"
        return f"not valid Unicode text (a lone surrogate U+{code:04X} at character {exc.start})"
    return None


def check_text(text: str, what: str) -> None:
    """Raise :class:`GenerationError` (``what: problem``) unless ``text`` is valid text."""
    problem = text_problem(text)
    if problem is not None:
        raise GenerationError(f"{what}: {problem}")


def _floating_tensors(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    seen: set[int] = set()
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_floating_point() and id(t) not in seen:
            seen.add(id(t))
            yield name, t


def check_weights(model: torch.nn.Module, where: str | Path | None = None) -> None:
    """Raise :class:`GenerationError` naming the first floating-point weight (parameter or
    buffer) that holds NaN or infinity, and where in it: such a model only ever produces
    NaN logits. One pass over the weights, a chunk at a time."""
    for name, t in _floating_tensors(model):
        found = first_nonfinite(t)
        if found is not None:
            index, value = found
            at = f"[{', '.join(map(str, index))}]" if index else ""
            prefix = f"{where}: " if where is not None else ""
            raise GenerationError(
                f"{prefix}weight {name}{at} is {value}, not a finite number; use another "
                "checkpoint (--weights best or latest) or train again"
            )


def decoding_bytes(
    model: Any, rows: int, width: int, new_tokens: int, beams: bool, penalty: bool
) -> int:
    """A lower bound of the memory decoding ``rows`` rows (prompts × beams) takes: each
    row's KV cache (when the model decodes through one), its token buffer and its logits
    (float32: the scores and their softmax; beam search also the candidates). Shapes only;
    nothing is allocated."""
    cfg = model.config
    limit = cfg.max_seq_len
    tokens = min(limit, width + new_tokens)
    per_row = 0
    if getattr(model, "supports_kv_cache", False):
        size = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
        for attn in model.attention_modules:
            window = getattr(getattr(attn, "kernel", None), "cache_window", None)
            kept = min(tokens, window) if window else tokens
            heads = getattr(attn, "n_kv_heads", cfg.n_heads)
            dim = getattr(attn, "head_dim", cfg.d_model // cfg.n_heads)
            per_row += 2 * heads * dim * size * kept
    cols = width + max(min(new_tokens, 4 * limit), 1)
    per_row += cols * 9  # ids (int64) and mask (bool)
    per_row += cfg.vocab_size * 4 * (3 if beams else 2) + (cfg.vocab_size if penalty else 0)
    return rows * per_row


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``: CUDA's free memory plus what its
    caching allocator holds unused; on the CPU ``MemAvailable`` (and the cgroup's limit,
    when it is lower); None when unknown (other devices)."""
    if device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
            unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        except (RuntimeError, AssertionError):
            return None
        return int(free + max(unused, 0))
    if device.type != "cpu":
        return None
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            found.append(max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_memory(
    model: Any,
    prompts: int,
    beams: int,
    width: int,
    new_tokens: int,
    penalty: bool,
    device: torch.device,
) -> None:
    """Raise :class:`GenerationError` when :func:`decoding_bytes` of ``prompts × beams``
    rows exceeds :func:`available_memory` (before anything is allocated)."""
    rows = prompts * max(beams, 1)
    need = decoding_bytes(model, rows, width, new_tokens, beams > 1, penalty)
    have = available_memory(device)
    if have is None or need <= have:
        return
    what = f"{prompts} prompt{'s' if prompts != 1 else ''}"
    if beams > 1:
        what += f" × {beams} beams"
    raise GenerationError(
        f"decoding {what} needs at least {_gib(need)} (KV cache, logits), more than the "
        f"{_gib(have)} available on {device}; use fewer beams or prompts, or fewer "
        "new tokens"
    )
