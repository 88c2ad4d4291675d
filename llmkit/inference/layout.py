"""The weight layout for decoding on a CPU: column-major weights while one or two rows decode
(BLAS's non-transposed GEMV streams them faster), row-major for more rows."""

from __future__ import annotations

import torch
from torch import nn

from llmkit.model import Transformer

#: On CPU, models llmkit loads for generation store the weights of the output head and of
#: every ``nn.Linear`` with at least as many outputs as inputs column-major (same values and
#: shapes, transposed strides; a tied token embedding shares the head's) while they decode
#: one or two rows at a time. x @ Wᵀ then runs as BLAS's non-transposed GEMV, which streams
#: such weights faster. Measured on a 2-core AMD EPYC (MKL, fp32, 2 threads), time per product
#: column-major / row-major: one row: GPT-2's 50257 × 768 head 0.57, 3072 × 768 0.66,
#: 2304 × 768 0.72, 768 × 768 0.93, but 768 × 3072 1.30 (so fewer outputs than inputs stays
#: row-major); two rows 0.50–0.85; four or more rows 0.96–1.48. So the layout follows the
#: number of rows a generation decodes (prompts × beams), switched at the start of a call
#: when it changes: a GPT-2-small greedy decode (1 × 32 prompt, 64 new tokens, one thread)
#: takes 2.06 s instead of 2.46 s. Set False (``llmkit.inference.layout.COLUMN_MAJOR_ON_CPU``,
#: read at each :func:`prepare_for_decoding`) to keep row-major.
COLUMN_MAJOR_ON_CPU = True
#: Decoding this many rows or fewer uses the column-major layout.
COLUMN_MAJOR_MAX_ROWS = 2


def decoding_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights whose layout decoding chooses: the output head, and each ``nn.Linear``
    with out_features ≥ in_features, each once (tied weights are one parameter)."""
    found: dict[int, nn.Parameter] = {}
    head = getattr(model, "lm_head", None)
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 2 or w.device.type != "cpu":
            continue
        if mod is head or (isinstance(mod, nn.Linear) and w.shape[0] >= w.shape[1]):
            found.setdefault(id(w), w)
    return list(found.values())


def set_layout(model: nn.Module, column_major: bool) -> None:
    """Store :func:`decoding_weights` column-major (or back row-major), values unchanged;
    a no-op under ``torch.inference_mode``."""
    if torch.is_inference_mode_enabled():  # the new storage must not be an inference tensor
        return
    with torch.no_grad():
        for w in decoding_weights(model):
            is_col = w.shape[0] > 1 and w.stride() == (1, w.shape[0])
            if column_major and not is_col:
                w.data = w.data.t().contiguous().t()
            elif not column_major and not w.is_contiguous():
                w.data = w.data.contiguous()


def prepare_for_decoding(model: Transformer, column_major: bool = True, rows: int = 1) -> None:
    """Give a CPU model the decoding layout for ``rows`` rows at a time (see
    :data:`COLUMN_MAJOR_ON_CPU`) and let later generations switch it to fit their number of
    rows; ``column_major=False`` restores the usual layout and stops the switching.

    The CLI, ``Generator(path)`` and ``llmkit bench generate`` do this to the models they
    load; a model you pass in is left as it is unless you call this. The weights stay ordinary
    trainable parameters, but they are no longer contiguous, and safetensors' ``save_model``
    refuses non-contiguous shared tensors: restore before saving."""
    wanted = column_major and COLUMN_MAJOR_ON_CPU
    model._llmkit_decoding_layout = wanted  # type: ignore[attr-defined]
    set_layout(model, wanted and rows <= COLUMN_MAJOR_MAX_ROWS)


def fit_layout(model: nn.Module, rows: int) -> None:
    """Switch a model prepared by :func:`prepare_for_decoding` to the layout for ``rows``."""
    if getattr(model, "_llmkit_decoding_layout", False):
        set_layout(model, rows <= COLUMN_MAJOR_MAX_ROWS)
