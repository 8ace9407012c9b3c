"""A registered GPU region: client GPU memory the daemon reached through a CUDA IPC handle.

It lives in the same :class:`~ucm_server.regions.RegionTable` as shared-memory regions (same ids,
same session ownership, same pin-while-copying rule) but it is not a memoryview: the daemon moves its
bytes with ``cudaMemcpyAsync`` (see :mod:`ucm_server.gpu.service`). This module imports no CUDA code,
so the region table can know the type on a daemon without cupy.
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
