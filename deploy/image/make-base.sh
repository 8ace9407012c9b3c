#!/usr/bin/env bash
# Make the two base images of the ucm-server Dockerfile locally, without any container registry:
#
#   ucm-base-build:<tag>  Debian minbase + python3 + python3-venv (the build stage: venv + pip)
#   ucm-base:<tag>        the same root file system with python3-venv, pip and setuptools purged
#                         (the runtime stage: python3 and nothing to install packages with)
#
# Both come from one `debootstrap --variant=minbase` of the pinned suite below, imported with
# `podman import`. Builds are as reproducible as the Debian suite is: pin the mirror to a
# snapshot (DEBIAN_MIRROR=http://snapshot.debian.org/archive/debian/<timestamp>) where you can reach
# it; the CI machines reach only deb.debian.org, so there the suite is pinned, not the snapshot, and
# the package list of the base is printed (and kept in the image as /etc/ucm-base.packages).
#
# Usage: deploy/image/make-base.sh [ENGINE]    ENGINE: podman (default) or docker
# Env:   DEBIAN_SUITE (bookworm), DEBIAN_MIRROR (http://deb.debian.org/debian), UCM_BASE_TAG
#        (default: the suite plus a digest of this script, so editing it makes new images).
# Idempotent: exits at once when both images exist.
set -euo pipefail
ENGINE="${1:-podman}"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
HERE="$(cd "$(dirname "$0")" && pwd)"
TAG="${UCM_BASE_TAG:-$SUITE-$(sha256sum "$HERE/make-base.sh" | cut -c1-12)}"
BUILD_IMAGE="localhost/ucm-base-build:$TAG"
RUNTIME_IMAGE="localhost/ucm-base:$TAG"

exists() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }
if exists "$BUILD_IMAGE" && exists "$RUNTIME_IMAGE"; then
    echo "$BUILD_IMAGE $RUNTIME_IMAGE"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "make-base.sh: debootstrap is not installed" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || { echo "make-base.sh: debootstrap needs root" >&2; exit 1; }

rootfs="$(mktemp -d /var/tmp/ucm-base.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$rootfs" "$MIRROR" >&2
# No apt lists, caches, docs or man pages in the image.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
       "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
import() {  # import <image>: the root file system as a one-layer image
    tar --numeric-owner --xattrs -C "$rootfs" -c . \
        | "$ENGINE" import --change 'CMD ["/bin/bash"]' --message "debootstrap $SUITE $MIRROR" - "$1" >/dev/null
}
chroot "$rootfs" dpkg-query -W -f '${Package} ${Version}\n' > "$rootfs/etc/ucm-base.packages"
import "$BUILD_IMAGE"
# The runtime base: nothing that installs Python packages (no venv, pip or setuptools wheels).
chroot "$rootfs" dpkg --purge python3-venv python3.11-venv python3-pip-whl python3-setuptools-whl >&2
chroot "$rootfs" dpkg-query -W -f '${Package} ${Version}\n' > "$rootfs/etc/ucm-base.packages"
import "$RUNTIME_IMAGE"
echo "$BUILD_IMAGE $RUNTIME_IMAGE"
