"""Benchmark set-up: only the built-in plugin unless asked; quick shapes unless full.

``LLMKIT_BENCH=full`` selects the full shapes; the default quick shapes keep CI short.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("LLMKIT_PLUGINS", "")

FULL = os.environ.get("LLMKIT_BENCH", "quick") == "full"

#: The example specs (importing tests.conftest instead would reset LLMKIT_PLUGINS).
SPECS = Path(__file__).resolve().parent.parent / "specs"
