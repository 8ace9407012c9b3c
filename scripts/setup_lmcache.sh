#!/usr/bin/env bash
# Create <repo>/.venv-lmcache with LMCache 0.5.6, CPU-only.
#
# Why a separate venv: LMCache pins protobuf<7, numpy<=2.2.6 and setuptools<81, which clash with the
# daemon's own dependencies (protobuf>=7), so the peer benchmark runs it in its own interpreter
# (benchmarks/peers/lmcache_peer.py) and the main venv only parses its JSON.
#
# Why not a plain `pip install lmcache`: the wheel declares cupy-cuda13x, cuda-python and cufile-python,
# which need CUDA to be useful and are huge; LMCache's CPU path never loads its CUDA ops module. So:
#   1. torch==2.13.0 first (pip picks a local +cpu wheel when one is on its find-links; PyPI's Linux
#      wheel otherwise, which also runs on CPU),
#   2. lmcache==0.5.6 with --no-deps,
#   3. lmcache's declared dependencies, read from the installed wheel's metadata, minus those three.
# Idempotent: a stamp file records a finished install; a second run only re-verifies the versions.
#
# Environment: PYTHON (interpreter for the venv, default python3.11, then python3),
#              LMCACHE_VENV (default <repo>/.venv-lmcache).
set -euo pipefail

LMCACHE_VERSION="0.5.6"
TORCH_VERSION="2.13.0"
EXCLUDED_DEPS="cupy-cuda13x cuda-python cufile-python"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LMCACHE_VENV:-${REPO_ROOT}/.venv-lmcache}"
VPY="${VENV}/bin/python"
STAMP="${VENV}/.ucm-lmcache-setup"
STAMP_TEXT="lmcache==${LMCACHE_VERSION} torch==${TORCH_VERSION} excluded=${EXCLUDED_DEPS}"

log() { echo "setup_lmcache: $*"; }
die() { echo "setup_lmcache: ERROR: $*" >&2; exit 1; }
trap 'rc=$?; [[ $rc -ne 0 ]] && echo "setup_lmcache: FAILED (exit $rc); rerun after fixing the error above" >&2' EXIT

# Prints "name==version" for an installed distribution, or nothing.
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
    local lv tv
    lv="$(installed_version lmcache)"
    tv="$(installed_version torch)"
    [[ "${lv}" == "${LMCACHE_VERSION}" ]] || return 1
    # A local +cpu build counts as the pinned version.
    [[ "${tv%%+*}" == "${TORCH_VERSION}" ]] || return 1
}

if [[ -f "${STAMP}" ]] && [[ "$(cat "${STAMP}")" == "${STAMP_TEXT}" ]] && versions_ok; then
    log "already installed in ${VENV} (lmcache $(installed_version lmcache), torch $(installed_version torch)); nothing to do"
    exit 0
fi

# --- 0. interpreter -----------------------------------------------------------------------------
pick_python() {
    local cand
    for cand in "${PYTHON:-}" python3.11 python3.12 python3.13 python3.10 python3; do
        [[ -n "${cand}" ]] || continue
        command -v "${cand}" >/dev/null 2>&1 || continue
        # lmcache 0.5.6 requires Python >=3.10,<3.14 and ships cp310..cp313 wheels.
        if "${cand}" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] < (3, 14) else 1)' \
            2>/dev/null; then
            echo "${cand}"
            return 0
        fi
    done
    return 1
}

if [[ ! -x "${VPY}" ]]; then
    BASE_PY="$(pick_python)" || die "no Python 3.10-3.13 found (set PYTHON=/path/to/python3.11)"
    log "creating venv ${VENV} with $(${BASE_PY} --version 2>&1) (${BASE_PY})"
    "${BASE_PY}" -m venv "${VENV}" || die "python -m venv ${VENV} failed (see above; on Debian the python3-venv package may be missing)"
else
    log "reusing existing venv ${VENV} ($("${VPY}" --version 2>&1))"
fi

PIP=("${VPY}" -m pip --disable-pip-version-check)

# --- 1. torch -----------------------------------------------------------------------------------
tv="$(installed_version torch)"
if [[ "${tv%%+*}" == "${TORCH_VERSION}" ]]; then
    log "torch ${tv} already installed"
else
    log "installing torch==${TORCH_VERSION} (this is the big download)"
    "${PIP[@]}" install "torch==${TORCH_VERSION}" || die "pip install torch==${TORCH_VERSION} failed"
    tv="$(installed_version torch)"
    if [[ "${tv}" != *+cpu ]]; then
        log "note: torch ${tv} is PyPI's CUDA build (no +cpu wheel on pip's indexes); it runs on CPU too"
    fi
fi

# --- 2. lmcache without its dependencies ----------------------------------------------------------
if [[ "$(installed_version lmcache)" == "${LMCACHE_VERSION}" ]]; then
    log "lmcache ${LMCACHE_VERSION} already installed"
else
    log "installing lmcache==${LMCACHE_VERSION} --no-deps"
    "${PIP[@]}" install --no-deps "lmcache==${LMCACHE_VERSION}" || die "pip install lmcache==${LMCACHE_VERSION} failed"
fi

# --- 3. lmcache's declared dependencies minus the CUDA-only ones ----------------------------------
REQS="$(mktemp "${TMPDIR:-/tmp}/lmcache-reqs.XXXXXX")"
trap 'rc=$?; rm -f "${REQS}"; [[ $rc -ne 0 ]] && echo "setup_lmcache: FAILED (exit $rc); rerun after fixing the error above" >&2' EXIT
# Read Requires-Dist from the installed wheel, drop extras-only requirements and the excluded
# CUDA packages; pip evaluates the remaining environment markers itself.
"${VPY}" - "${EXCLUDED_DEPS}" >"${REQS}" <<'EOF' || die "could not read lmcache's declared dependencies"
import re
import sys
from importlib import metadata

excluded = {n.lower().replace("_", "-") for n in sys.argv[1].split()}
for req in metadata.requires("lmcache") or []:
    if "extra ==" in req.replace("extra==", "extra =="):
        continue
    name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name in excluded:
        continue
    print(req)
EOF
log "installing $(wc -l <"${REQS}") declared dependencies (excluding: ${EXCLUDED_DEPS}):"
sed 's/^/    /' "${REQS}"
log "pip will report lmcache's three CUDA requirements as missing: that is expected and harmless"
# Re-state the torch pin so the resolver never swaps the CPU build for another one.
"${PIP[@]}" install -r "${REQS}" "torch==${TORCH_VERSION}" || die "pip install of lmcache's dependencies failed"

# --- 4. verify ------------------------------------------------------------------------------------
versions_ok || die "after install: lmcache=$(installed_version lmcache) torch=$(installed_version torch), expected ${LMCACHE_VERSION} / ${TORCH_VERSION}"
[[ -x "${VENV}/bin/lmcache" ]] || die "${VENV}/bin/lmcache missing after install"
log "checking that the CPU path imports (lmcache server module, ZMQ client)"
LMCACHE_TRACK_USAGE=false "${VPY}" -c 'import lmcache, zmq, torch; print("  lmcache", lmcache.__file__); print("  torch", torch.__version__, "cuda available:", torch.cuda.is_available())' \
    || die "lmcache does not import in ${VENV}"
echo "${STAMP_TEXT}" >"${STAMP}"
log "done: ${VENV} (lmcache $(installed_version lmcache), torch $(installed_version torch))"
