"""Fixtures for the connector tests: a tiny local Llama and real daemons."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.tiny_llama import build_tiny_llama
from vllm_helpers import start_daemon

from ucm_server.testing.daemon import DaemonProcess


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path) -> Path:
    """The default tiny Llama (seed 0): 2 layers, 2 KV heads of 32, float32."""
    return Path(build_tiny_llama(models_dir))


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Any]:
    """Start daemons on demand; every one still running is stopped at the end of the test."""
    started: list[DaemonProcess] = []

    def factory(name: str, *args: str, data_dir: Path | None = None) -> DaemonProcess:
        daemon = start_daemon(tmp_path / name, *args, data_dir=data_dir)
        started.append(daemon)
        return daemon

    yield factory
    for daemon in started:
        daemon.kill()
