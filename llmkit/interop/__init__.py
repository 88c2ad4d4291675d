"""Hugging Face interoperability: checkpoints in (``llmkit import-hf``) and out
(``llmkit export-hf``), one module per architecture family, proven by logit parity.

- :mod:`~llmkit.interop.convert`: in memory (:func:`hf_to_llmkit`, :func:`llmkit_to_hf`,
  :func:`to_transformers`);
- :mod:`~llmkit.interop.runs`: between directories (:func:`import_hf`, :func:`export_hf`);
- :mod:`~llmkit.interop.family`: what a family provides; :mod:`~llmkit.interop.families`;
- :mod:`~llmkit.interop.family_common`: the helpers families share (never one another's);
- :mod:`~llmkit.interop.mapping`: tensor rules; :mod:`~llmkit.interop.hf_files`: files;
- :mod:`~llmkit.interop.hf_tokenizer`: tokenizer files both ways.
- :mod:`~llmkit.interop.local_files`: what import may read of a checkpoint (files inside
  it; JSON bounded in size and depth).
- :mod:`~llmkit.interop.remote`: the remote-code export of what no family holds (the files
  of :mod:`~llmkit.interop.remote_code`, copied verbatim), and reading it back.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "export_hf",
    "hf_to_llmkit",
    "import_hf",
    "llmkit_to_hf",
    "supported_model_types",
    "to_transformers",
]


def __getattr__(name: str) -> Any:  # lazy: importing the package costs no torch
    if name in ("hf_to_llmkit", "llmkit_to_hf", "supported_model_types", "to_transformers"):
        from llmkit.interop import convert

        return getattr(convert, name)
    if name in ("import_hf", "export_hf"):
        from llmkit.interop import runs

        return getattr(runs, name)
    raise AttributeError(name)
