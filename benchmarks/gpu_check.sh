#!/usr/bin/env bash
# GPU check of the Triton kernels: bf16 correctness against fp32 references, then speed
# against PyTorch SDPA's flash backend. Needs a CUDA GPU; takes a few minutes on an H200
# (the benchmarks stop at a 420 s budget, the whole run is killed at $GPU_CHECK_TIMEOUT).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR] [gpu_check.py options]
#
# OUT_DIR defaults to $OUT, else ./gpu-check; it receives gpu_check.md (the tables),
# gpu_check.json and PNG plots. $PYTHON picks the interpreter (default: .venv/bin/python if
# present, else python3). Exit status: 0 all good, 1 a check failed or a kernel is missing,
# 2 no CUDA GPU. See benchmarks/gpu_check.py for what is checked and measured.
set -euo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-gpu-check}"
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
    out="$1"
    shift
fi
if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"
elif [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=python3
fi
if [ -n "${TRITON_INTERPRET:-}" ]; then
    echo "note: unsetting TRITON_INTERPRET (the check runs the compiled kernels)" >&2
    unset TRITON_INTERPRET
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
mkdir -p "$out"
exec timeout "${GPU_CHECK_TIMEOUT:-470}" "$py" -m benchmarks.gpu_check --out "$out" "$@"
