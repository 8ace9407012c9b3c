#!/usr/bin/env bash
# Install Mooncake Store (client library + mooncake_master) into the active Python environment.
#
# Why a script: the CPU-only wheel has a different name from the CUDA one, and tests/support/services.py
# looks for `mooncake_master` next to the venv's python. Idempotent: pip skips an installed version.
set -euo pipefail
: "${MOONCAKE_PACKAGE:=mooncake-transfer-engine-non-cuda==0.3.13.post1}"
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
    echo "install_mooncake.sh: activate the project venv first (. .venv/bin/activate)" >&2
    exit 2
fi
# The wheel links libibverbs/librdmacm/libnuma even for TCP; Debian slims often lack them.
if ! ldconfig -p | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q libnuma.so.1; then
    SUDO=""
    [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends libibverbs1 librdmacm1 libnuma1 >/dev/null
fi
python -m pip install --quiet "${MOONCAKE_PACKAGE}"
command -v mooncake_master >/dev/null || { echo "mooncake_master not on PATH after install" >&2; exit 1; }
python -c "from mooncake.store import MooncakeDistributedStore"
echo "mooncake: $(command -v mooncake_master)"
