"""Packed documents: the ids that keep attention inside each document of a training row.

A packed row holds several documents end to end. Llama 3 trains so that a token attends only
to earlier tokens of its own document and positions restart at 0 in each (Llama Team 2024,
"The Llama 3 Herd of Models", §3.2). The model takes that as ``document_ids`` (B, T): an
integer per token, non-decreasing along each row, equal within a document
(:meth:`llmkit.model.Transformer.forward`); these helpers make and check them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from llmkit.errors import LlmkitError
from llmkit.ops import document_bounds

__all__ = [
    "check_document_ids",
    "document_ids_from_bounds",
    "document_ids_from_eos",
    "document_positions",
]


def document_ids_from_eos(idx: Tensor, eos_id: int) -> Tensor:
    """Document ids (int64, ``idx``'s shape (..., T)) of token ids ``idx`` packed with
    ``eos_id`` between documents: a token after an EOS starts a new document, and the EOS
    belongs to the document it ends (Llama 3's convention). Each row starts at 0."""
    eos = (idx == eos_id).long()
    return eos.cumsum(-1) - eos


def document_ids_from_bounds(
    starts: Sequence[Sequence[int]], length: int, *, device: torch.device | str | None = None
) -> Tensor:
    """Document ids (B, ``length``) int64 from each row's document start offsets (``starts[b]``,
    the first token of each document; 0 is implied, offsets outside 1 … length−1 are
    ignored, so a list of lengths' running sums works as is)."""
    marks = torch.zeros(len(starts), length + 1, dtype=torch.long)
    for row, offsets in enumerate(starts):
        for s in offsets:
            if 0 < int(s) < length:
                marks[row, int(s)] = 1
    return marks[:, :length].cumsum(1).to(device)


def check_document_ids(document_ids: Tensor, idx: Tensor) -> Tensor:
    """``document_ids`` on ``idx``'s device after checking they are integer, shaped like
    ``idx`` (B, T) and, for CPU tensors outside ``torch.compile``, non-decreasing along each
    row (a GPU would make the host wait for the check every step, so there it is the caller's
    promise). Raises :class:`LlmkitError`."""
    if document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
        raise LlmkitError(f"document_ids must be integer, got {document_ids.dtype}")
    if tuple(document_ids.shape) != tuple(idx.shape):
        raise LlmkitError(
            f"document_ids has shape {tuple(document_ids.shape)}; expected the tokens' "
            f"{tuple(idx.shape)}"
        )
    document_ids = document_ids.to(idx.device)
    if (
        document_ids.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and bool((document_ids[:, 1:] < document_ids[:, :-1]).any())
    ):
        raise LlmkitError("document_ids must be non-decreasing along each row (packed documents)")
    return document_ids


def document_positions(document_ids: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
    """(B, T) int64 position of each token within its document: 0 at each document's first
    token; with ``key_padding_mask`` (B, T) (True = real token), the number of real tokens of
    its document before it."""
    starts, _ = document_bounds(document_ids)
    if key_padding_mask is None:
        return torch.arange(document_ids.shape[-1], device=document_ids.device) - starts
    m = key_padding_mask.long()
    before = m.cumsum(-1) - m  # real tokens before each token in its row
    return before - before.gather(-1, starts)
