#
# ucm-server: the UCM storage daemon, nothing else (no torch, no vLLM, no cupy, no pip).
#
# Build (no registry needed; tests/deploy/ does exactly this on every CI run):
#   deploy/image/make-base.sh                # prints the two base images it made (debootstrap + import)
#   podman build --format docker --build-arg BASE_TAG=<tag it printed> -t ucm-server:0.1.0 .
# `--format docker` matters for podman/buildah: the OCI image format has no HEALTHCHECK and they drop it
# (with a warning). Docker builds need no flag. There is deliberately no `# syntax=` line: it makes
# BuildKit pull a frontend image, which fails on air-gapped build hosts. Where pip needs the host's
# proxy settings or CA bundle: podman build -v /etc/pip.conf:/etc/pip.conf:ro -v <bundle>:<bundle>:ro.
#
# Run (see docs/operations.md, "Docker / podman"):
#   install -d -o 10001 -g 10001 -m 0700 /run/ucm /var/lib/ucm   # and deploy/image/ucm-tmpfiles.conf
#   docker run -d --name ucm --stop-timeout 60 \
#       -v /run/ucm:/run/ucm -v /var/lib/ucm:/var/lib/ucm -p 127.0.0.1:9464:9464 ucm-server:0.1.0
#
# The daemon runs as uid/gid 10001. Clients (vLLM) must run as the same uid (the socket and its .fds
# companion are 0600 in a 0700 directory) and mount the same socket directory; they hand their memory
# to the daemon as file descriptors over that socket, so no --ipc=host and no shared /dev/shm.
#
# Settings: /etc/ucm/ucm.yaml (deploy/image/ucm.yaml, baked in; mount your own over it or over /etc/ucm).
# No UCM_* ENV here: environment beats the file in ucm-server, so an image ENV would silently override
# a mounted config. The HEALTHCHECK reads the same file (ucm-admin --config), so it probes the socket
# the daemon actually uses; `docker run -e UCM_SOCKET=...` reaches both alike, a --socket flag does not.

# The bases come from deploy/image/make-base.sh (debootstrap of Debian bookworm, --variant=minbase):
# the build base has python3-venv, the runtime base has python3 and no pip/setuptools/venv.
ARG BASE_TAG=bookworm
ARG BUILD_BASE=localhost/ucm-base-build:${BASE_TAG}
ARG RUNTIME_BASE=localhost/ucm-base:${BASE_TAG}

# -- build: the package and its pinned runtime dependencies in a venv --------------------------------
FROM ${BUILD_BASE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONSTRAINT=/src/constraints.txt
RUN python3 -m venv /opt/ucm
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
COPY ucm_protocol ./ucm_protocol
COPY ucm_server ./ucm_server
COPY ucm_client ./ucm_client
# The base install only (constraints.txt pins every version, the build backend included). No extras:
# torch/vllm/cupy are client-side. Then pip and setuptools leave the venv: the runtime installs nothing.
RUN /opt/ucm/bin/pip install . \
    && /opt/ucm/bin/ucm-server --version \
    && /opt/ucm/bin/python -c "import sys, ucm_server.server, ucm_client.admin.cli; \
bad = {'torch', 'vllm', 'cupy'} & set(sys.modules); sys.exit(f'unexpected imports: {bad}' if bad else 0)" \
    && /opt/ucm/bin/python -m pip uninstall --yes pip setuptools

# -- runtime ------------------------------------------------------------------------------------------
FROM ${RUNTIME_BASE}
LABEL org.opencontainers.image.title="ucm-server" \
      org.opencontainers.image.description="UCM (Unified Cache Manager) KV-cache storage daemon" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid 10001 ucm \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/ucm --no-create-home \
               --shell /usr/sbin/nologin ucm \
    && install -d -o 10001 -g 10001 -m 0700 /run/ucm \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/ucm \
    && install -d -o root -g root -m 0755 /etc/ucm

COPY --from=build /opt/ucm /opt/ucm
COPY deploy/image/ucm.yaml /etc/ucm/ucm.yaml

ENV PATH=/opt/ucm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
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
# covers the index rebuild. --config: the socket of the daemon's own config file and environment.
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ucm-admin --config /etc/ucm/ucm.yaml --timeout 5 -q health || exit 1

# The daemon handles SIGTERM itself: health goes NOT_SERVING, running tasks get 10 s, write-back
# drains, tiers close. Give it more than Docker's default 10 s: docker stop -t 60 / --stop-timeout 60.
STOPSIGNAL SIGTERM
ENTRYPOINT ["ucm-server", "--config", "/etc/ucm/ucm.yaml"]
CMD []
