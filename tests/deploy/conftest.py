"""Fixtures of the deployment suite: podman, the bootstrapped base images and the ucm-server image;
and the artifacts read as data (the Dockerfile, the Kubernetes objects) for the artifact checks.

Session-scoped: the base is bootstrapped (or found in podman's store from an earlier run) and the image
built once per test run, whatever number of tests use them.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from support import podman as pm
from support.deploy_artifacts import Image, read_image, read_manifests
from support.podman import HostDirs, make_host_dirs


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
    return pm.build_server_image(base_images)


@pytest.fixture
def host_dirs(podman_ready: None) -> Iterator[HostDirs]:
    dirs = make_host_dirs()
    yield dirs
    shutil.rmtree(dirs.root, ignore_errors=True)


@pytest.fixture(scope="module")
def image() -> Image:
    return read_image()


@pytest.fixture(scope="module")
def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """Every Kubernetes object under deploy/k8s, by (kind, name)."""
    return read_manifests()
