"""The remote code of an llmkit model that no native transformers family holds.

``llmkit export-hf`` copies :data:`FILES` verbatim from this directory into the exported
checkpoint and names their classes in ``config.json``'s ``auto_map``, so
``transformers.AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` builds
llmkit's own Transformer from the spec saved in ``config.json`` (``llmkit_spec``). The files
import llmkit where they are loaded; they download nothing. See :mod:`llmkit.interop.remote`.
"""

from __future__ import annotations

from pathlib import Path

#: The files an export writes, as they are here.
FILES = ("configuration_llmkit.py", "modeling_llmkit.py")
#: Where they are.
DIRECTORY = Path(__file__).resolve().parent
