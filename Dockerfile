#
# ucm-server: the UCM storage daemon, nothing else (no torch, no vLLM, no cupy, no pip).
#
# Build, anywhere a registry is reachable (the default bases: the official python:3.11-slim-bookworm,
# pinned by digest, for both stages):
#   docker build -t ucm-server:0.1.0 .                       # or: podman build --format docker ...
# Build air-gapped (no registry; tests/deploy/ does exactly this on every CI run): bases made locally
# by deploy/image/make-base.sh (debootstrap of Debian bookworm + import), passed as build arguments:
#   deploy/image/make-base.sh                # prints the two base images it made
#   podman build --format docker --build-arg BUILD_BASE=localhost/ucm-base-build:<tag> \
#       --build-arg RUNTIME_BASE=localhost/ucm-base:<tag> -t ucm-server:0.1.0 .
# The two stages must use the same Python at the same path (the venv points at it): set both
# arguments together. `--format docker` matters for podman/buildah: the OCI image format has no
# HEALTHCHECK and they drop it (with a warning). Docker builds need no flag. There is deliberately no
# `# syntax=` line: it makes BuildKit pull a frontend image, which fails on air-gapped build hosts.
# Where pip needs the host's proxy settings or CA bundle:
#   podman build -v /etc/pip.conf:/etc/pip.conf:ro -v <bundle>:<bundle>:ro ...
#
# Run (see docs/operations.md, "Docker / podman"):
#   install -d -o 10001 -g 10001 -m 0700 /run/ucm /var/lib/ucm   # and deploy/image/ucm-tmpfiles.conf
#   docker run -d --name ucm --stop-timeout 60 \
#       -v /run/ucm:/run/ucm -v /var/lib/ucm:/var/lib/ucm -p 127.0.0.1:9464:9464 ucm-server:0.1.0
#   docker exec ucm ucm-admin stats          # finds the daemon through UCM_SERVER_CONFIG, no flag
#
# The daemon runs as uid/gid 10001. Clients (vLLM) must run as the same uid (the socket and its .fds
# companion are 0600 in a 0700 directory) and mount the same socket directory; they hand their memory
# to the daemon as file descriptors over that socket, so no --ipc=host and no shared /dev/shm.
#
# Settings: /etc/ucm/ucm.yaml (deploy/image/ucm.yaml, baked in; mount your own over it or over /etc/ucm).
# The image sets one UCM_* variable, UCM_SERVER_CONFIG: it names that file, for ucm-server (which reads
# it when given no --config) and for ucm-admin (which then finds the socket the file names, with the
# daemon's UCM_SOCKET applied), so the HEALTHCHECK and `docker exec ... ucm-admin` need no flag. It
# sets no setting: environment beats the file in ucm-server, so a setting's ENV here would silently
# override a mounted config. `docker run -e UCM_SOCKET=...` reaches the daemon and the admin tool
# alike, a --socket flag to the daemon does not.

# Default bases: the official Python image, pinned by digest (docker-library/repo-info lists it for
# python:3.11-slim-bookworm, Python 3.11.16). Air-gapped: deploy/image/make-base.sh's two bases
# (the build base has python3-venv, the runtime base has python3 and no pip/setuptools/venv).
ARG PYTHON_BASE=docker.io/library/python:3.11-slim-bookworm@sha256:fe556eaffd0d96abd8685b83bb8a69addd0dc730fa193669a7df0d49ddcfac02
ARG BUILD_BASE=${PYTHON_BASE}
ARG RUNTIME_BASE=${PYTHON_BASE}

# -- build: the package and its pinned runtime dependencies in a venv --------------------------------
FROM ${BUILD_BASE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONSTRAINT=/src/constraints.txt
# The compiled helper (ucm_protocol._native: the local data plane, per-block loops without the GIL)
# needs a C compiler and Python's headers, from Debian's own packages (xxHash's header is vendored).
# This stage only: the runtime image has no compiler.
# Where no mirror answers (an air-gapped base without them), the package installs without the helper,
# as on any machine without a compiler: clients then use gRPC for every call, as they always could.
RUN if ! command -v gcc >/dev/null; then \
        headers=python3-dev; python3 -c 'import os, sysconfig; \
assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' 2>/dev/null && headers=; \
        { apt-get -o Acquire::Retries=0 -o Acquire::http::Timeout=20 update \
          && apt-get install -y --no-install-recommends gcc libc6-dev $headers; } \
        || echo "ucm: no C compiler from apt; the compiled helper is not built, the data plane stays off"; \
        rm -rf /var/lib/apt/lists/*; \
    fi
RUN python3 -m venv /opt/ucm
WORKDIR /src
COPY constraints.txt pyproject.toml setup.py README.md ./
COPY ucm_protocol ./ucm_protocol
COPY ucm_server ./ucm_server
COPY ucm_client ./ucm_client
# The base install only (constraints.txt pins every version, the build backend included). No extras:
# torch/vllm/cupy are client-side. Then pip and setuptools leave the venv: the runtime installs nothing.
RUN /opt/ucm/bin/pip install . \
    && /opt/ucm/bin/ucm-server --version \
    && cd / && /opt/ucm/bin/python -c "import shutil, sys; from ucm_protocol.native import native, MISSING; \
print('ucm: compiled helper', 'built' if native is not None else 'not built (no compiler)'); \
sys.exit(MISSING if native is None and shutil.which('gcc') else 0)" \
    && cd /src \
    && /opt/ucm/bin/python -c "import sys, ucm_server.server, ucm_client.admin.cli; \
bad = {'torch', 'vllm', 'cupy'} & set(sys.modules); sys.exit(f'unexpected imports: {bad}' if bad else 0)" \
    && /opt/ucm/bin/python -m pip uninstall --yes pip setuptools

# -- runtime ------------------------------------------------------------------------------------------
FROM ${RUNTIME_BASE}
LABEL org.opencontainers.image.title="ucm-server" \
      org.opencontainers.image.description="UCM (Unified Cache Manager) KV-cache storage daemon" \
      org.opencontainers.image.licenses="Apache-2.0"

# Nothing that installs Python packages stays in the image: the official base ships pip, setuptools
# and ensurepip's wheels (make-base.sh's runtime base has none; then this finds nothing to remove).
RUN if python3 -c "import pip" 2>/dev/null; then python3 -m pip uninstall --yes --quiet pip setuptools wheel; fi \
    && rm -rf "$(python3 -c 'import os, sysconfig; print(os.path.join(sysconfig.get_path("stdlib"), "ensurepip"))')" \
              /usr/share/python-wheels \
    && groupadd --system --gid 10001 ucm \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/ucm --no-create-home \
               --shell /usr/sbin/nologin ucm \
    && install -d -o 10001 -g 10001 -m 0700 /run/ucm \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/ucm \
    && install -d -o root -g root -m 0755 /etc/ucm

COPY --from=build /opt/ucm /opt/ucm
COPY deploy/image/ucm.yaml /etc/ucm/ucm.yaml

ENV PATH=/opt/ucm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    UCM_SERVER_CONFIG=/etc/ucm/ucm.yaml \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/var/lib/ucm

# Socket directory (share it with clients) and block store (persist it: blocks survive restarts).
VOLUME ["/run/ucm", "/var/lib/ucm"]

# Prometheus /metrics (metrics_address in /etc/ucm/ucm.yaml). The gRPC API is the Unix socket.
EXPOSE 9464

USER 10001:10001

# ucm-admin health exits 0 when the daemon answers SERVING, 1 when it is not serving (shutting down),
# 3 when it is unreachable (still rebuilding its index at start-up, or dead), 2 when the config file is
# wrong. Docker defines only exit codes 0 and 1 for health checks, hence "|| exit 1". The start period
# covers the index rebuild. No flag: UCM_SERVER_CONFIG gives it the daemon's own config file.
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ucm-admin --timeout 5 -q health || exit 1

# The daemon handles SIGTERM itself: health goes NOT_SERVING, running tasks get 10 s, write-back
# drains, tiers close. Give it more than Docker's default 10 s: docker stop -t 60 / --stop-timeout 60.
STOPSIGNAL SIGTERM
ENTRYPOINT ["ucm-server"]
CMD []
