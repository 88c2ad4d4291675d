"""The attention check's document part (:func:`llmkit.testing.check_component` runs it for
kernels that declare ``supports_document_mask``): packed documents (``document_ids``) give
each document what it gives alone, outputs and gradients, with a bias, non-causal where
allowed, and with fewer queries than keys."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from llmkit.contracts import DistanceBias
from llmkit.ops import reference_attention
from llmkit.testing.common import _close, _expect, _maxdiff, _randn

_SLOPES = (0.5, 0.25, 0.125, 0.0625)
Kernel = Callable[..., Tensor]  # llmkit.testing.attention's checked call (takes ``what=``)


def _grads(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, weights: Tensor, **kw: Any):
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    (kernel(qg, kg, vg, what="backward with documents", **kw) * weights).sum().backward()
    return qg.grad, kg.grad, vg.grad


#: Document lengths of the two packed rows of the document checks (12 tokens each).
_DOCUMENTS = ((3, 4, 5), (1, 6, 5))


def _document_ids(t: int, dev: torch.device) -> Tensor:
    rows = [torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in _DOCUMENTS]
    ids = torch.stack(rows).to(dev)
    assert ids.shape[1] == t, "the document checks are written for 12 tokens"
    return ids


def _document_spans() -> list[tuple[int, int, int]]:
    """(row, first token, end) of every document of :data:`_DOCUMENTS`."""
    spans = []
    for row, lengths in enumerate(_DOCUMENTS):
        start = 0
        for n in lengths:
            spans.append((row, start, start + n))
            start += n
    return spans


def check_documents(record, kernel, q, k, v, out, window, exact, tol, caps, sites) -> None:
    """``document_ids``: each document of a packed row gives what it gives alone; one
    document is the plain call; queries take the ids of the last Tq keys."""
    dev, T = q.device, q.shape[2]
    ids = _document_ids(T, dev)
    one = kernel(q, k, v, document_ids=torch.zeros_like(ids), what="one document per row")
    _expect(
        _close(one, out, 1e-5, 1e-5),
        record,
        f"document_ids putting every token in one document differ from the plain call by "
        f"{_maxdiff(one, out):.2e}",
    )
    calls: list[dict[str, Any]] = [{}]
    if "score_bias" in sites:
        calls.append({"bias": DistanceBias(torch.tensor(_SLOPES, device=dev))})
    if not caps.get("causal_only"):
        calls.append({"causal": False})
    for kw in calls:
        tag = f" ({kw})" if kw else ""
        packed = kernel(q, k, v, document_ids=ids, what=f"packed documents{tag}", **kw)
        for row, s, e in _document_spans():
            part = (slice(row, row + 1), slice(None), slice(s, e))
            alone = kernel(q[part], k[part], v[part], what=f"one document alone{tag}", **kw)
            _expect(
                _close(packed[part], alone, 1e-5, 1e-5),
                record,
                f"document_ids{tag}: tokens {s}..{e - 1} of row {row} (one document) differ "
                f"from the same document run alone by {_maxdiff(packed[part], alone):.2e}: "
                "attention must stay inside each document",
            )
        if exact:
            w = window if kw.get("causal", True) else None
            ref = reference_attention(q, k, v, document_ids=ids, window=w, **kw)
            _expect(
                _close(packed, ref, tol, tol),
                record,
                f"document_ids{tag}: differ from reference_attention by "
                f"{_maxdiff(packed, ref):.2e}",
            )
        for tq in (1, 3):
            part = kernel(
                q[:, :, -tq:], k, v, document_ids=ids, what=f"documents, last {tq} queries", **kw
            )
            _expect(
                _close(part, packed[:, :, -tq:], 1e-5, 1e-5),
                record,
                f"document_ids{tag}: the last {tq} queries against all keys differ from the "
                f"full output by {_maxdiff(part, packed[:, :, -tq:]):.2e} (document_ids are "
                "(B, Tk), one per key; queries take the last Tq)",
            )


def check_document_grads(record, kernel, q, k, v, gen, dev) -> None:
    """Gradients through packed documents equal those of each document run alone."""
    ids = _document_ids(q.shape[2], dev)
    weights = _randn(gen, *q.shape, device=dev)
    got = _grads(kernel, q, k, v, weights, document_ids=ids)
    for row, s, e in _document_spans():
        part = (slice(row, row + 1), slice(None), slice(s, e))
        alone = _grads(kernel, q[part], k[part], v[part], weights[part])
        for name, a, b in zip("qkv", got, alone):
            _expect(
                _close(a[part], b, 1e-5, 1e-5),
                record,
                f"document_ids: the gradient of {name} over tokens {s}..{e - 1} of row {row} "
                f"differs from the document's alone by {_maxdiff(a[part], b):.2e}",
            )
