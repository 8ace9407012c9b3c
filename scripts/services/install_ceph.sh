#!/usr/bin/env bash
# Install the Ceph daemons needed for a one-node S3 endpoint (mon + memstore OSD + RGW).
#
# Ceph RGW is the only real S3-compatible server available on this machine; the tests start it on
# loopback through tests/support/services.py. Idempotent: skips apt when every binary is present.
set -euo pipefail
need=(ceph-mon ceph-osd radosgw radosgw-admin ceph)
missing=0
for b in "${need[@]}"; do command -v "$b" >/dev/null || missing=1; done
if [[ $missing -eq 0 ]]; then
    echo "ceph: already installed ($(ceph --version))"
    exit 0
fi
SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends ceph-mon ceph-osd radosgw ceph-common >/dev/null
# The packages enable systemd units where systemd runs; our tests start their own daemons instead.
echo "ceph: installed ($(ceph --version))"
