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


def _machine() -> dict[str, object]:
    """Where a benchmark ran: CPU model, its matrix-relevant flags, cores, torch, threads."""
    import torch

    from llmkit.hardware import cpu_flags, cpu_name

    return {
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def pytest_report_header(config) -> str:
    """Every benchmark run's output starts with the machine it ran on (CPU flags included)."""
    m = _machine()
    return (
        f"llmkit benchmarks: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['cpu_flags'])}, "
        f"torch {m['torch']}, {m['torch_threads']} threads, "
        f"{'full' if FULL else 'quick'} shapes"
    )


def pytest_benchmark_update_machine_info(config, machine_info: dict) -> None:
    """pytest-benchmark's saved JSON (``--benchmark-json``) records the same machine facts."""
    machine_info["llmkit"] = _machine()
