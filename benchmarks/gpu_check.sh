#!/usr/bin/env bash
# GPU check of UCM's CUDA IPC data path, for a machine with one NVIDIA GPU, torch (CUDA) and cupy.
#
#   bash benchmarks/gpu_check.sh fetch      # on a machine WITH network: wheels into .whl/ (about 8 MB)
#   bash benchmarks/gpu_check.sh [options]  # on the GPU machine (no network needed): the check itself
#
# The check (benchmarks/gpu_check.py, all steps bounded by timeouts, about a minute in all; 2 GiB per transfer by default):
#   1. a ucm-server with a pinned Cache (gpu: on) and a separate client process with torch CUDA tensors
#      registered by CUDA IPC; N 2 MiB blocks dumped GPU -> daemon and loaded into another GPU tensor,
#      bytes compared; then the same through Cache|Posix with a Cache too small to hold them;
#   2. throughput of dump and load against plain cudaMemcpyAsync device <-> pinned host of the same blocks
#      in the client process, in the same run; prints JSON and a markdown table, writes them to $OUT
#      (or --out) as gpu_check.json / gpu_check.md.
# Then it runs `pytest tests/gpu` (log in pytest-gpu.log), which on a GPU includes the real-CUDA
# round trips of tests/gpu/test_gpu_cuda.py (whole blocks, a vLLM-style KV cache, layerwise loads).
# Options go to gpu_check.py (--blocks N, --rounds R); see --help. Whole run: well under 10 minutes, each step under `timeout`.
#
# What it needs beyond the GPU image (torch, cupy, grpcio, protobuf, uvloop, prometheus-client, pyyaml,
# xxhash, rich): grpcio-health-checking and grpcio-reflection, and grpcio/protobuf at least as new as the
# generated stubs. `fetch` downloads exactly those as wheels into .whl/; the check installs them into a
# private directory on PYTHONPATH (never into the system) when they are present.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS="$ROOT/.whl"

if [[ "${1:-}" == "fetch" ]]; then
    mkdir -p "$WHEELS"
    if [[ -d .git ]] && ! grep -qx '/.whl/' .git/info/exclude 2>/dev/null; then
        echo '/.whl/' >> .git/info/exclude
    fi
    for pkg in grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1; do
        timeout 300 "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
            -d "$WHEELS" "$pkg"
    done
    ls -la "$WHEELS"
    exit 0
fi

OUT_DIR="${OUT:-/tmp/ucm-gpu-check}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

if compgen -G "$WHEELS/*.whl" > /dev/null; then
    SITE="$(mktemp -d /tmp/ucm-gpu-site.XXXX)"
    if timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl; then
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "warning: the wheels in .whl/ did not install; trying with the packages already here"
    fi
fi
if ! "$PY" -c "import grpc_health, grpc_reflection, google.protobuf" 2> /dev/null; then
    echo "warning: grpcio-health-checking / grpcio-reflection missing: run 'bash benchmarks/gpu_check.sh fetch'" \
        "on a machine with network and bring .whl/ along"
fi
# The project itself: an editable install where pip can do it offline, else straight from the checkout.
if ! timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT_DIR/pip-install.log" 2>&1; then
    echo "pip install -e . failed (see $OUT_DIR/pip-install.log); using the checkout on PYTHONPATH"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

timeout 20 nvidia-smi -L || echo "nvidia-smi not available"
rc=0
timeout 420 "$PY" "$ROOT/benchmarks/gpu_check.py" --out "$OUT_DIR" "$@" || rc=$?
# The GPU tests of the suite too (real-device tests are skipped elsewhere with "no CUDA device").
echo "== pytest tests/gpu"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$OUT_DIR/pytest-gpu.log" | tail -15 || true
exit "$rc"
