"""What the client remembers of each region handle, and the map from handles to the daemon's ids.

A region handle is the client's own id, never reused within a client; :class:`RegionRecord` keeps
what registering its memory again after a daemon restart needs, :class:`HandleMap` resolves handles
to the daemon's current region ids (a lost or not yet re-registered handle raises, naming it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ucm_client.buffers import SharedBuffer
from ucm_client.cuda_ipc import CudaIpcExport
from ucm_client.errors import RegionLost
from ucm_protocol.errors import Unavailable
from ucm_protocol.ucm.v1 import ucm_pb2 as pb


@dataclass(slots=True)
class RegionRecord:
    """What the client knows of one region handle, to register its memory again after a restart."""

    size: int
    label: str
    server_id: int | None
    """The daemon's id for this memory now; None while not (yet) registered with the current daemon."""
    cuda: CudaIpcExport | None = None
    lost: str | None = None
    """Why the handle is dead (its re-registration failed); it then never maps to a region id again."""
    buffer: SharedBuffer | None = None
    """Host memory: kept so that a restarted daemon can be handed the same memfd again."""

    def request(self, memfd_token: bytes = b"") -> pb.RegisterRegionRequest:
        if self.cuda is None:
            return pb.RegisterRegionRequest(memfd_token=memfd_token, size=self.size, label=self.label)
        c = self.cuda
        return pb.RegisterRegionRequest(
            size=c.size,
            label=self.label,
            cuda_ipc_handle=c.handle,
            cuda_offset=c.offset,
            cuda_device=c.device,
            cuda_device_uuid=c.device_uuid,
        )


class HandleMap(Mapping[int, int]):
    """Client region handles -> the daemon's region ids now; a lost or not yet re-registered handle
    raises a typed error naming it instead of resolving to any id."""

    def __init__(self, regions: dict[int, RegionRecord]) -> None:
        self._regions = regions

    def __getitem__(self, handle: int) -> int:
        record = self._regions[handle]  # KeyError: never registered (or unregistered)
        if record.lost is not None:
            raise RegionLost(handle, record.lost)
        if record.server_id is None:
            raise Unavailable(f"region handle {handle} is not registered with the daemon yet (reconnecting)")
        return record.server_id

    def __iter__(self) -> Iterator[int]:
        return iter(self._regions)

    def __len__(self) -> int:
        return len(self._regions)
