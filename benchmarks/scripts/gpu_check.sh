#!/usr/bin/env bash
# The one prepared GPU run: kernel tests, GPU tests, the kernels' correctness and speed tables,
# and end-to-end training side by side with nanoGPT, in at most 8 minutes on one H200, at most
# 8 files in OUT (benchmarks/scripts/gpu_run.py has the stages, budgets and files).
#
#   bash benchmarks/scripts/gpu_check.sh [OUT] [--nanogpt PATH] [gpu_run.py options]
#   bash benchmarks/scripts/gpu_check.sh --fetch-wheels [--with-datasets]  # here (pip works)
#   bash benchmarks/scripts/gpu_check.sh --prepare [--nanogpt PATH] [--corpus PATH]   # here
#
# OUT defaults to $OUT, else ./gpu-check. It receives (at most 8 files, each rewritten as the
# run goes, so a run cut short keeps what it measured): summary.md and summary.json (every
# stage: test counts, headline kernel numbers, the end-to-end table), run.log, tests.log,
# gpu_check.md / gpu_check.json / gpu_check_attention.png (the kernel tables), e2e.log.
# Stages and default budgets (seconds; time a stage leaves unused goes to the next): pytest
# tests/kernels 85, pytest tests/gpu 85, kernel tables 150, end to end 150; the whole run
# stops at 480 s ($GPU_CHECK_TIMEOUT; `--deadline S`, `--budget e2e=200,tables=120`), the
# wheels' install (~5 s) before. Give the device tool's run a timeout_s of 570 or more.
#
# Exit status: 0 all ran and passed; 1 a test, check or run failed; 2 no CUDA GPU or a
# missing Python package; 124 out of time (a stage cut or not started).
#
# What the device machine lacks, and what to carry (name each in the device tool's `carry`;
# all three are git-excluded, about 10 MiB together):
#   .whl       pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions
#              for CPython 3.12 x86-64 (`--fetch-wheels`); installed into a temporary folder
#              on PYTHONPATH. Everything else llmkit imports at `llmkit train` time (torch,
#              triton, pluggy, numpy, tokenizers, safetensors, rich, yaml, packaging, jinja2,
#              matplotlib, scipy) is in the device image; `datasets` is not, and is not
#              needed by the end-to-end stage: see .gpucheck. tests/gpu trains from corpora it
#              writes itself, so it does need `datasets`: `--fetch-wheels --with-datasets` adds
#              datasets, dill and multiprocess (0.9 MiB; datasets 5.2 wants pyarrow >= 24, a
#              version the device image was never seen to have: summary.md's environment
#              says whether `import datasets` worked there).
#              llmkit itself is not installed there: its built-in plugin's entry point is
#              written into that folder as a dist-info (from pyproject.toml), so the registry
#              finds its components.
#   .gpucheck  data/tinyshakespeare.txt (the corpus inside the checkout: only the checkout
#              travels) and cache/ (LLMKIT_CACHE_DIR: the char tokenizer and token files,
#              keyed by the corpus's content, so the GPU run tokenizes nothing and needs no
#              `datasets`). Made by `--prepare`, which checks that in a child without datasets.
#              Run `--prepare` again after changing llmkit's data code or the spec written by
#              gpu_train_compare.py: the cache key holds the source options, tokenizer spec and
#              token format too, and a miss on the device means tokenizing (with datasets).
#   .nanogpt   a copy of nanoGPT (git archive of karpathy/nanoGPT) with
#              data/shakespeare_char/{train,val}.bin and meta.pkl made from the same corpus by
#              benchmarks/scripts/nanogpt_data.py (`--prepare --nanogpt .nanogpt`; made on the
#              device too when missing). Never copied into tracked files.
#
# The device command (≤ 2000 characters), carry [".whl", ".gpucheck", ".nanogpt"]:
#   bash benchmarks/scripts/gpu_check.sh $OUT --nanogpt .nanogpt
#
# $PYTHON picks the interpreter (default: the first of .venv/bin/python and python3 whose
# torch sees a GPU).
set -euo pipefail
cd "$(dirname "$0")/../.."

wheels=.whl
if [ "${1:-}" = "--fetch-wheels" ]; then
    py="${PYTHON:-.venv/bin/python}"
    pyver="${WHEEL_PYTHON_VERSION:-3.12}"
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    names="pydantic pydantic-core annotated-types typing-inspection typing-extensions"
    if [ "${2:-}" = "--with-datasets" ]; then
        names="$names datasets dill multiprocess"
    fi
    # shellcheck disable=SC2086
    pins=$("$py" - $names <<'EOF'
import importlib.metadata as md, sys
print(" ".join(f"{n}=={md.version(n)}" for n in sys.argv[1:]))
EOF
)
    # shellcheck disable=SC2086
    "$py" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$wheels" $pins
    ls -l "$wheels"
    exit 0
fi
if [ "${1:-}" = "--prepare" ]; then
    shift
    exec "${PYTHON:-.venv/bin/python}" -m benchmarks.scripts.gpu_train_compare --prepare "$@"
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
# shellcheck disable=SC2016
need='import importlib.util, importlib.metadata as md, sys
need = ("torch", "triton", "pydantic", "pluggy", "numpy", "yaml", "rich", "tokenizers",
        "safetensors", "packaging", "jinja2", "pytest")
gone = [m for m in need if importlib.util.find_spec(m) is None]
if not any(e.name == "builtin" for e in md.entry_points(group="llmkit")):
    gone.append("llmkit-entry-point")
print(" ".join(gone))
sys.exit(1 if gone else 0)'
site="${TMPDIR:-/tmp}/gpu-check-site"
if ! "$py" -c "$need" >/dev/null 2>&1; then
    mkdir -p "$site"
    if compgen -G "$wheels/*.whl" >/dev/null; then
        PIP_ROOT_USER_ACTION=ignore "$py" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl \
            || echo "warning: could not install $wheels/*.whl for $py" >&2
    fi
    # llmkit is not installed on the device machine: its built-in plugin's entry point.
    "$py" - "$site" <<'EOF' || echo "warning: could not write llmkit's entry point" >&2
import sys, tomllib
from pathlib import Path
project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
info = Path(sys.argv[1]) / f"llmkit-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: llmkit\nVersion: {project['version']}\n")
eps = project["entry-points"]
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items())
    for group, items in eps.items()))
EOF
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! missing=$("$py" -c "$need" 2>&1); then
    echo "error: $py lacks Python packages: $missing" >&2
    echo "  (for pydantic & co: run 'bash benchmarks/scripts/gpu_check.sh --fetch-wheels' where pip" >&2
    echo "  works, then bring .whl/ along; torch and triton must come with the machine)" >&2
    exit 2
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
mkdir -p "$out"
deadline="${GPU_CHECK_TIMEOUT:-480}"
# gpu_run.py keeps its own deadline; this one only catches a hang past it.
rc=0
timeout -k 10 "$((deadline + 30))" "$py" -m benchmarks.scripts.gpu_run --out "$out" \
    --deadline "$deadline" "$@" || rc=$?
exit "$rc"
