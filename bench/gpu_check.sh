#!/usr/bin/env bash
# The GPU check of issue 30, in under 8 minutes on a fresh H200 machine, install included:
# decode tokens/s of random ~1B and ~8B Llamas in bf16 at batch 1 and 32, our engine (static
# step compiled into CUDA graphs, and the same step eager; each with overlapped steps on and
# off) next to HF generate() (eager, and
# with a compiled static cache) and the HBM bound, our tokens checked against HF's
# (bench/gpu_decode_bench.py). docs/engine.md, "GPU", says how to run it.
#
#   bash bench/gpu_check.sh [ARGS...]     # on the GPU machine; ARGS go to gpu_decode_bench.py
#   bench/gpu_check.sh --dry-run          # here: the same path on CPU with a tiny config
#   bench/gpu_check.sh --fetch-wheels     # for a GPU machine without PyPI (see below)
#
# Which python: $PYTHON if set; else, for --dry-run, this checkout's .venv; else a venv of its
# own ($GPU_CHECK_VENV, default /tmp/slotserve-gpu-venv, reused when it already imports torch)
# built from PyPI: torch==2.13.0 (the CUDA build PyPI serves for Linux) and the project
# (pip install ./ ./engine, which pins it). Without PyPI it falls back to the machine's python3
# if that imports torch, transformers and tokenizers, installing the rest from .whl/ (made by
# --fetch-wheels where there is network; the device tool carries it), or from PyPI when only
# the venv could not be made (no venv module). Results go to $OUT (the
# device tool's folder that comes back) or bench/results/: gpu_check.json and gpu_check.log.
#
# Environment: PYTHON, GPU_CHECK_VENV, GPU_CHECK_TIMEOUT (seconds for the benchmark, default
# 360), DEVICE_PYTHON (--fetch-wheels' target version, default 3.12).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

WHEELS=.whl
TORCH_VERSION=2.13.0
# The engine's imports beyond what a device image with torch holds (pydantic-core is binary).
PACKAGES=(pydantic pydantic-core pydantic-settings python-dotenv typing-inspection
    annotated-types typing-extensions)
MODULES=(pydantic pydantic_core pydantic_settings dotenv typing_inspection annotated_types)

fetch_wheels() {
    local py=.venv/bin/python specs=() package version exclude
    [[ -x $py ]] || { echo "gpu_check: --fetch-wheels reads pinned versions from .venv: run 'make venv' first"; exit 2; }
    for package in "${PACKAGES[@]}"; do
        version=$("$py" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$package") ||
            { echo "gpu_check: $package is not installed in .venv"; exit 2; }
        specs+=("$package==$version")
    done
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF "/$WHEELS/" "$exclude" 2>/dev/null || echo "/$WHEELS/" >>"$exclude"
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$py" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version "${DEVICE_PYTHON:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" "${specs[@]}" || exit 2
    ls -1 "$WHEELS"
    echo "gpu_check: carry $WHEELS to the device machine (device tool: carry [\"$WHEELS\"])"
}

# A venv from PyPI; prints its python, or fails (no network, no python3 venv module).
pypi_venv() {
    local venv=${GPU_CHECK_VENV:-/tmp/slotserve-gpu-venv} start=$SECONDS
    if "$venv/bin/python" -c 'import torch, transformers, slotserve.engine' 2>/dev/null; then
        echo "$venv/bin/python"
        return 0
    fi
    python3 -m venv "$venv" >&2 || return 1
    # torch first (the largest download), then the project, which pins the same torch.
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --timeout 30 \
        --retries 2 "torch==$TORCH_VERSION" >&2 &&
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check ./ ./engine >&2 ||
        return 1
    echo "gpu_check: built $venv from PyPI in $((SECONDS - start)) s" >&2
    echo "$venv/bin/python"
}

if [[ ${1:-} == --fetch-wheels ]]; then
    fetch_wheels
    exit 0
fi

dry_run=0
for arg in "$@"; do [[ $arg == --dry-run ]] && dry_run=1; done
PY=${PYTHON:-}
if [[ -z $PY && $dry_run == 1 ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
elif [[ -z $PY ]]; then
    PY=$(pypi_venv) || {
        echo "gpu_check: no venv from PyPI (no network?); trying this machine's python3"
        PY=python3
    }
fi
# One interpreter start (torch takes seconds to import): versions, then the modules it lacks.
preflight=$("$PY" -c 'import importlib.util, sys
import tokenizers, torch, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "${MODULES[@]}" 2>/tmp/gpu-check-preflight.err) || {
    tail -n 1 /tmp/gpu-check-preflight.err 2>/dev/null
    echo "gpu_check: $PY cannot import torch, transformers and tokenizers, and they could not" \
        "be installed from PyPI: use a python that has them through PYTHON=..."
    exit 2
}
echo "gpu_check: $(head -n 1 <<<"$preflight")"
missing=$(tail -n +2 <<<"$preflight")
if [[ -n $missing ]]; then
    site=$(mktemp -d /tmp/gpu-check-site.XXXXXX)
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
            --target "$site" "$WHEELS"/*.whl || { echo "gpu_check: installing $WHEELS failed"; exit 2; }
    else
        # The pins of the root pyproject.toml, from PyPI if it answers.
        pins=$(grep -oE '"pydantic(-settings)?==[^"]+"' pyproject.toml | tr -d '"')
        # shellcheck disable=SC2086  # one argument per pin
        "$PY" -m pip install --quiet --disable-pip-version-check --timeout 30 --target "$site" \
            $pins >/dev/null 2>&1 || {
            echo "gpu_check: $PY lacks $missing and PyPI did not answer; run" \
                "'bench/gpu_check.sh --fetch-wheels' where there is network, and carry $WHEELS along"
            exit 2
        }
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# `slotserve` is a namespace package spread over the repo root and engine/: this checkout's
# sources come first, installed or not.
export PYTHONPATH="$PWD:$PWD/engine${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

out_dir=${OUT:-bench/results}
mkdir -p "$out_dir"
limit=${GPU_CHECK_TIMEOUT:-360}
command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
        --format=csv,noheader

timeout --kill-after=10 "$limit" "$PY" bench/gpu_decode_bench.py \
    --out "$out_dir/gpu_check.json" "$@" 2>&1 | tee "$out_dir/gpu_check.log"
rc=${PIPESTATUS[0]}
case $rc in
    0) echo "gpu_check: done; $out_dir/gpu_check.json" ;;
    2) echo "gpu_check: not run (see above)" ;;
    124 | 137) echo "gpu_check: stopped after ${limit} s; $out_dir/gpu_check.json holds the models that finished" ;;
    *) echo "gpu_check: failed (exit $rc); $out_dir/gpu_check.log has the output" ;;
esac
exit "$rc"
