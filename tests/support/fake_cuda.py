"""A fake CUDA backend: host memory plays device memory, so the daemon's GPU path runs on any CPU.

It keeps CUDA's asynchrony where it matters for correctness: ``copy_async`` only queues copies, and
bytes move when the event recorded after them is waited for (in stream order). Code that published a
block or reported it OK before waiting would therefore see stale bytes and fail the tests. Errors can be
injected into queueing or into completion, and every open handle, stream, event and pinned buffer is
counted so tests can check that nothing leaks.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from ucm_server.gpu.backend import CudaError, Piece

UUID = b"fake-gpu-uuid-00"


@dataclass
class FakeCuda:
    name: str = "fake"
    devices: int = 1
    fail_copy: str = ""
    """Raise this from the next copy_async (queueing fails)."""
    fail_wait: str = ""
    """Raise this from the next wait (the copies fail on the device); the copies do not happen."""
    registered: dict[int, int] = field(default_factory=dict)
    opened: dict[int, bytes] = field(default_factory=dict)
    opens: int = 0
    pinned: dict[int, ctypes.Array[ctypes.c_char]] = field(default_factory=dict)
    streams: set[int] = field(default_factory=set)
    queued: dict[int, list[tuple[int, list[Piece]]]] = field(default_factory=dict)
    """stream -> [(event, pieces)] not yet completed."""
    copies: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._event_stream: dict[int, int] = {}

    # -- fake device memory, exported by the "client" ---------------------------------------------------
    _allocations: ClassVar[dict[bytes, ctypes.Array[ctypes.c_char]]] = {}  # shared, like the driver

    @classmethod
    def allocate(cls, size: int) -> tuple[bytes, ctypes.Array[ctypes.c_char]]:
        """Device memory of ``size`` bytes and its 64-byte IPC handle."""
        mem = (ctypes.c_char * size)()
        handle = f"fake-ipc-{ctypes.addressof(mem):x}".encode().ljust(64, b"\0")
        cls._allocations[handle] = mem
        return handle, mem

    # -- the backend ------------------------------------------------------------------------------------
    def device_count(self) -> int:
        return self.devices

    def device_uuid(self, device: int) -> bytes:
        return UUID[:-1] + bytes([device])

    def open_ipc(self, device: int, handle: bytes) -> tuple[int, int | None]:
        mem = self._allocations.get(handle)
        if mem is None:
            raise CudaError("cudaIpcOpenMemHandle: cudaErrorInvalidResourceHandle")
        ptr = ctypes.addressof(mem)
        if ptr in self.opened:
            raise CudaError("cudaIpcOpenMemHandle: opened twice in one process")
        self.opened[ptr] = handle
        self.opens += 1
        return ptr, ctypes.sizeof(mem)

    def close_ipc(self, device: int, ptr: int) -> None:
        if self.opened.pop(ptr, None) is None:
            raise CudaError("cudaIpcCloseMemHandle: not open")

    def host_register(self, ptr: int, size: int) -> None:
        self.registered[ptr] = size

    def host_unregister(self, ptr: int) -> None:
        self.registered.pop(ptr)

    def host_alloc(self, size: int) -> int:
        mem = (ctypes.c_char * size)()
        self.pinned[ctypes.addressof(mem)] = mem
        return ctypes.addressof(mem)

    def host_free(self, ptr: int) -> None:
        self.pinned.pop(ptr)

    def create_stream(self, device: int) -> int:
        stream = next(self._ids)
        self.streams.add(stream)
        return stream

    def destroy_stream(self, device: int, stream: int) -> None:
        self.streams.remove(stream)

    def copy_async(self, device: int, stream: int, pieces: Sequence[Piece], to_device: bool) -> int:
        with self._lock:
            if self.fail_copy:
                message, self.fail_copy = self.fail_copy, ""
                raise CudaError(message)
            event = next(self._ids)
            self.queued.setdefault(stream, []).append((event, list(pieces)))
            self._event_stream[event] = stream
            nbytes = sum(n for _, _, n in pieces)
            if to_device:
                self.h2d_bytes += nbytes
            else:
                self.d2h_bytes += nbytes
            return event

    def wait(self, device: int, event: int) -> None:
        with self._lock:
            stream = self._event_stream.pop(event)
            queue = self.queued[stream]
            if all(e != event for e, _ in queue):
                return  # completed already, with a later event of its stream
            if self.fail_wait:
                message, self.fail_wait = self.fail_wait, ""
                queue[:] = [q for q in queue if q[0] != event]
                raise CudaError(message)
            while queue:  # stream order: everything queued before this event completes with it
                done, pieces = queue.pop(0)
                for dst, src, n in pieces:
                    ctypes.memmove(dst, src, n)
                    self.copies += 1
                if done == event:
                    break

    @property
    def outstanding(self) -> int:
        return sum(len(q) for q in self.queued.values())
