"""A registered GPU region: client GPU memory the daemon reached through a CUDA IPC handle.

It lives in the same :class:`~ucm_server.regions.RegionTable` as shared-memory regions (same ids,
same session ownership, same pin-while-copying rule) but it is not a memoryview: the daemon moves its
bytes with ``cudaMemcpyAsync`` (see :mod:`ucm_server.gpu.service`). This module imports nothing, no
CUDA code either: the region table knows the type on a daemon without cupy, and below the GPU path
(which uses the table) rather than inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)  # identity: regions are pinned in sets
class GpuRegion:
    region_id: int
    session_id: str
    name: str
    size: int
    label: str
    device: int
    """The daemon's ordinal of the device that holds the memory."""
    ptr: int
    """Address of the region's first byte in the daemon's mapping of the allocation."""
    release: Callable[[], None] | None = None
    """Drops this region's reference on the IPC mapping (the last one closes the handle)."""
    users: int = 0
    closing: bool = False

    def close(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            release()


@dataclass(frozen=True, slots=True)
class CudaImport:
    """A client's request to share GPU memory: its allocation's CUDA IPC handle (64 bytes), the
    region's byte offset in it and size, the device by ordinal and UUID, and a label."""

    handle: bytes
    offset: int
    size: int
    device: int
    device_uuid: bytes
    label: str
