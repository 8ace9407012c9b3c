"""A real daemon run inside the test process (its own thread and event loop), so the fake CUDA backend
(:mod:`support.fake_cuda`) can stand in for cupy; everything from the client's ``register_cuda`` to
the device copies is the production path."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from support.fake_cuda import FakeCuda
from ucm_client.cuda_ipc import CudaIpcExport
from ucm_server.config import ServerConfig
from ucm_server.server import Daemon

T = TypeVar("T")


class InProcessDaemon:
    def __init__(self, workdir: Path, fake: FakeCuda) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(workdir, 0o700)  # the daemon's socket directory must be private
        self.config = ServerConfig(
            socket=workdir / "ucm.sock",
            data_dir=workdir / "data",
            store_pipeline="Cache|Posix",
            cache_capacity=32 << 20,
            durable=False,
            metrics_address="off",
        ).validate()
        self.fake = fake
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    @property
    def target(self) -> str:
        return f"unix://{self.config.socket}"

    def __enter__(self) -> InProcessDaemon:
        self.thread.start()

        async def start() -> Daemon:
            daemon = Daemon(self.config)
            daemon.engine.gpu.backend_factory = lambda: self.fake
            await daemon.start()
            return daemon

        self.daemon = self._run(start())
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.loop.is_closed():
            return  # stopped already
        try:
            self._run(self.daemon.shutdown(1.0))
        finally:
            # A real daemon's data-directory locks go with its process; this one's process stays.
            for fd in getattr(self.daemon, "_locks", []):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def export(fake: FakeCuda, handle: bytes, size: int, offset: int = 0) -> CudaIpcExport:
    return CudaIpcExport(handle, offset, size, 0, fake.device_uuid(0))
