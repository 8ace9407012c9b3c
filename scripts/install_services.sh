#!/usr/bin/env bash
# Install the real storage engines the test suite starts on loopback: Mooncake Store (pip, into the
# project venv) and Ceph RGW (Debian packages; needs root or sudo); and podman, debootstrap, kubectl and
# kubernetes-validate, with which tests/deploy/ builds and runs the image, the unit and the manifests. A failure here is reported and
# the tests that need that engine skip with the reason; the rest of the suite still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export VIRTUAL_ENV="${VIRTUAL_ENV:-$PWD/.venv}"
export PATH="$VIRTUAL_ENV/bin:$PATH"
status=0
for script in scripts/services/install_mooncake.sh scripts/services/install_ceph.sh \
              scripts/services/install_podman.sh; do
    [[ -f "$script" ]] || continue
    echo "== $script"
    if ! bash "$script"; then
        echo "!! $script failed: tests that need it will skip" >&2
        status=1
    fi
done
exit 0
