"""The ``norm`` kind: the position-wise properties of :func:`~llmkit.testing.check_ffn`."""

from __future__ import annotations

import torch

from llmkit.testing.common import Options, Record
from llmkit.testing.ffn import _check_pointwise


def check_norm(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """Check a norm: the same generic properties as :func:`check_ffn` (nothing assumed about
    its statistics)."""
    _check_pointwise(record, options, device)
