"""Fixtures of the deployment suite: podman, the bootstrapped base images and the ucm-server image.

Session-scoped: the base is bootstrapped (or found in podman's store from an earlier run) and the image
built once per test run, whatever number of tests use them.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import podman as pm
from support.podman import UCM_UID, HostDirs, owned_dir


@pytest.fixture(scope="session")
def podman_ready() -> None:
    reason = pm.unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def base_images(podman_ready: None) -> tuple[str, str]:
    try:
        return pm.make_base()
    except pm.PodmanUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def server_image(base_images: tuple[str, str]) -> str:
    return pm.build_server_image(base_images[1])


@pytest.fixture
def host_dirs() -> Iterator[HostDirs]:
    """A fresh /run/ucm, /var/lib/ucm and /etc/ucm on the host, owned by the daemon's uid where needed.

    Under /tmp with a 0711 root so the client (running as uid 10001 on the host) can reach the socket.
    """
    root = Path(tempfile.mkdtemp(prefix="ucm-deploy-", dir="/tmp"))
    root.chmod(0o711)
    dirs = HostDirs(
        root,
        owned_dir(root / "run", UCM_UID, 0o700),
        owned_dir(root / "data", UCM_UID, 0o700),
        owned_dir(root / "etc", 0, 0o755),
    )
    yield dirs
    shutil.rmtree(root, ignore_errors=True)
