#!/usr/bin/env bash
# Install what tests/deploy/ needs to run the deployment artifacts for real:
#   podman + runc (build and run the ucm-server image; runc because crun cannot set the open-files
#   limit on these hosts, see deploy/image/containers.conf), debootstrap (the base image, made locally:
#   no container registry is reachable), systemd (systemd-tmpfiles, systemd-analyze), kubectl (renders
#   deploy/k8s; from the configured apt sources when it is not installed yet) and kubernetes-validate
#   (PyPI, into the project venv: validates the manifests offline against the schemas it ships).
# Then it makes the base images once (deploy/image/make-base.sh), so the first test does not pay for
# the bootstrap; podman keeps them for later runs on the same machine.
# Needs root (or sudo). A failure is reported; the tests that need the missing piece skip with the reason.
set -euo pipefail
cd "$(dirname "$0")/../.."
SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive

want=()
for pair in podman:podman runc:runc debootstrap:debootstrap systemd-tmpfiles:systemd systemd-analyze:systemd; do
    command -v "${pair%%:*}" >/dev/null || want+=("${pair#*:}")
done
if ! command -v kubectl >/dev/null; then
    if apt-cache policy kubectl 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        want+=(kubectl)
    else
        echo "podman: kubectl is not in the apt sources here: the kustomize rendering tests will skip" >&2
    fi
fi
if ((${#want[@]})); then
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
fi
echo "podman: $(podman --version), $(runc --version | head -1), debootstrap $(dpkg-query -W -f '${Version}' debootstrap)"

python="${VIRTUAL_ENV:-$PWD/.venv}/bin/python"
if [[ -x "$python" ]] && ! "$python" -c "import kubernetes_validate" 2>/dev/null; then
    "$python" -m pip install --quiet "kubernetes-validate==1.37.0"
fi

if [[ $(id -u) -eq 0 ]]; then
    CONTAINERS_CONF="$PWD/deploy/image/containers.conf" bash deploy/image/make-base.sh podman
fi
