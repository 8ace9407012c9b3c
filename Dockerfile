# syntax=docker/dockerfile:1
#
# ucm-server: the UCM storage daemon, nothing else (no torch, no vLLM, no cupy).
#
#   docker build -t ucm-server:0.1.0 .
#   docker run -d --name ucm --ipc=host --stop-timeout 60 \
#       -v /run/ucm:/run/ucm -v /var/lib/ucm:/var/lib/ucm -p 127.0.0.1:9464:9464 ucm-server:0.1.0
#
# The daemon runs as uid/gid 10001. Clients (vLLM) must run as the same uid: the socket is 0600, and
# client memory (sealed memfds) is handed over through the socket directory only by peers of the
# daemon's uid; no shared /dev/shm is needed. Host directories bind-mounted on /run/ucm and
# /var/lib/ucm must belong to 10001 (chown 10001:10001 them once; /run/ucm must also be mode 0700).
#
# Settings come from UCM_* variables (set below), an optional YAML file (--config /etc/ucm/ucm.yaml,
# e.g. mounted from a ConfigMap) and flags; see docs/operations.md. Not built in CI here: no Docker
# engine on the build machines; tests/test_deploy.py checks this file statically.

ARG PYTHON_IMAGE=python:3.11-slim

# -- build: install the package and its runtime dependencies into a venv --------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/ucm
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ucm_server ./ucm_server
COPY ucm_client ./ucm_client
# The base install only: grpcio (+health, reflection), protobuf, uvloop, pyyaml, prometheus-client,
# xxhash, rich, numpy. No extras: torch/vllm/cupy are client-side (the vllm and gpu extras).
RUN /opt/ucm/bin/pip install . \
    && /opt/ucm/bin/ucm-server --version \
    && /opt/ucm/bin/python -c "import sys, ucm_server.server, ucm_client.admin.cli; \
bad = {'torch', 'vllm', 'cupy'} & set(sys.modules); sys.exit(f'unexpected imports: {bad}' if bad else 0)"

# -- runtime ------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
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

ENV PATH=/opt/ucm/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/var/lib/ucm \
    UCM_SOCKET=/run/ucm/ucm.sock \
    UCM_DATA_DIR=/var/lib/ucm \
    UCM_METRICS_ADDRESS=0.0.0.0:9464

# Socket directory (share it with clients) and block store (persist it: blocks survive restarts).
VOLUME ["/run/ucm", "/var/lib/ucm"]

# Prometheus /metrics (UCM_METRICS_ADDRESS). The gRPC API is the Unix socket, not a port.
EXPOSE 9464

USER 10001:10001

# ucm-admin health exits 0 when the daemon answers SERVING, 1 when it is not serving (shutting down),
# 3 when it is unreachable (still rebuilding its index at start-up, or dead). Docker defines only exit
# codes 0 and 1 for health checks, hence "|| exit 1". The start period covers the index rebuild.
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ucm-admin --socket "$UCM_SOCKET" --timeout 5 -q health || exit 1

# The daemon handles SIGTERM itself: health goes NOT_SERVING, running tasks get 10 s, write-back
# drains, tiers close. Give it more than Docker's default 10 s: docker stop -t 60 / --stop-timeout 60.
STOPSIGNAL SIGTERM
ENTRYPOINT ["ucm-server"]
CMD []
