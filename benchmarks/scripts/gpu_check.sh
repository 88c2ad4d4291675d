#!/usr/bin/env bash
# GPU check of the Triton kernels: bf16 correctness against fp32 references, then speed
# against PyTorch SDPA's flash backend. Needs a CUDA GPU; takes a few minutes on an H200
# (the benchmarks stop at a 420 s budget, the whole run is killed at $GPU_CHECK_TIMEOUT s).
#
#   bash benchmarks/scripts/gpu_check.sh [OUT_DIR] [gpu_check.py options]
#   bash benchmarks/scripts/gpu_check.sh --fetch-wheels    # on a machine with pip access, see below
#
# OUT_DIR defaults to $OUT, else ./gpu-check; it receives gpu_check.md (the tables),
# gpu_check.json and PNG plots; the .md and .json are rewritten after every check and
# benchmark case, so a run cut short keeps what it measured. $PYTHON picks the interpreter
# (default: the first of .venv/bin/python and python3 whose torch sees a GPU). Exit status:
# 0 all good, 1 a check failed, a kernel is missing or broke, 2 no CUDA GPU or a missing
# Python package, 124 out of time. All attempts together stop at $GPU_CHECK_TIMEOUT (470 s,
# Triton compiles of ~40 kernel variants included): a caller's own limit should be ≥ 540 s.
#
# A kernel fault (illegal memory access) poisons the process's CUDA context: gpu_check.py
# then exits 3 (or the process dies), and this script resumes in a fresh process, skipping
# the component that broke (it is reported) and keeping everything else.
#
# Python packages: llmkit needs pydantic (+ pydantic-core, annotated-types,
# typing-inspection), which this workplace's CUDA image (python 3.12, torch 2.11, triton 3.6)
# lacks. `--fetch-wheels` (run where pip can reach PyPI) downloads them for CPython 3.12
# x86-64 into .whl/ and git-excludes it; when .whl/ exists (name it in the device tool's
# `carry`), they are installed into a temporary folder first and put on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/../.."

wheels=.whl
if [ "${1:-}" = "--fetch-wheels" ]; then
    py="${PYTHON:-.venv/bin/python}"
    pyver="${WHEEL_PYTHON_VERSION:-3.12}"
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    pins=$("$py" - <<'EOF'
import importlib.metadata as md
print(" ".join(f"{n}=={md.version(n)}" for n in
               ("pydantic", "pydantic-core", "annotated-types", "typing-inspection",
                "typing-extensions")))
EOF
)
    # shellcheck disable=SC2086
    "$py" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$wheels" $pins
    ls -l "$wheels"
    exit 0
fi

out="${OUT:-gpu-check}"
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
    out="$1"
    shift
fi
# The interpreter: $PYTHON, else the first of .venv/bin/python and python3 whose torch sees a
# GPU, else the first that has torch at all (it then reports the missing GPU).
py="${PYTHON:-}"
for want in cuda torch; do
    for cand in .venv/bin/python python3; do
        if [ -z "$py" ] && "$cand" -c "import sys, torch
sys.exit('$want' == 'cuda' and not torch.cuda.is_available())" >/dev/null 2>&1; then
            py="$cand"
        fi
    done
done
py="${py:-python3}"
if [ -n "${TRITON_INTERPRET:-}" ]; then
    echo "note: unsetting TRITON_INTERPRET (the check runs the compiled kernels)" >&2
    unset TRITON_INTERPRET
fi
if compgen -G "$wheels/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/gpu-check-site"
    if PIP_ROOT_USER_ACTION=ignore "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl; then
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "warning: could not install $wheels/*.whl for $py" >&2
    fi
fi
if ! missing=$("$py" - 2>&1 <<'EOF'
import importlib.util, sys
need = ("torch", "triton", "pydantic", "pluggy", "numpy", "yaml", "rich")
gone = [m for m in need if importlib.util.find_spec(m) is None]
print(" ".join(gone))
sys.exit(1 if gone else 0)
EOF
); then
    echo "error: $py lacks Python packages: $missing" >&2
    echo "  (for pydantic & co: run 'bash benchmarks/scripts/gpu_check.sh --fetch-wheels' where pip" >&2
    echo "  works, then bring .whl/ along; torch and triton must come with the machine)" >&2
    exit 2
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
mkdir -p "$out"

# One deadline for all attempts; a resumed attempt reloads $out/gpu_check.json.
end=$((SECONDS + ${GPU_CHECK_TIMEOUT:-470}))
resume=()
rc=0
for attempt in 1 2 3 4; do
    left=$((end - SECONDS))
    if [ "$left" -lt 15 ]; then
        echo "error: gpu_check.sh: out of time before attempt $attempt" >&2
        rc=124
        break
    fi
    rc=0
    timeout -k 10 "$left" "$py" -m benchmarks.scripts.gpu_check --out "$out" ${resume[@]+"${resume[@]}"} "$@" \
        || rc=$?
    # 3: a kernel broke the CUDA context; > 128: killed by a signal (a crash), except
    # timeout's own SIGKILL (137) and SIGTERM (124 is timeout's status).
    if [ "$rc" -eq 3 ] || { [ "$rc" -gt 128 ] && [ "$rc" -ne 137 ]; }; then
        echo "note: gpu_check exited with status $rc; resuming in a fresh process" >&2
        resume=(--resume)
        continue
    fi
    break
done
if [ "$rc" -eq 3 ]; then
    rc=1
fi
exit "$rc"
