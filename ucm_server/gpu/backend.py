"""The few CUDA runtime calls the daemon needs, behind one small interface, and its cupy implementation.

The daemon never imports torch and treats cupy as optional (the ``[gpu]`` extra): cupy is imported
only when the first GPU region is registered (or at start with ``gpu: on``). Everything above this
module talks to :class:`CudaBackend`, so the copy logic is exercised on CPU-only machines with a fake
backend (``tests/support/fake_cuda.py``) and only this file needs a real GPU to be proven.

All calls that may block (host registration, copies, waits) are made from executor threads; cupy
releases the GIL inside them. Errors surface as :class:`CudaError` so callers never import cupy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

from ucm_protocol.errors import FailedPrecondition

log = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)

# cudaMemcpyKind, cudaHostRegister/cudaHostAlloc flags, stream and event flags (driver_types.h).
_H2D, _D2H = 1, 2
_HOST_PORTABLE = 1
_STREAM_NON_BLOCKING = 1
_EVENT_BLOCKING_SYNC, _EVENT_DISABLE_TIMING = 1, 2

Piece = tuple[int, int, int]
"""One contiguous copy: (destination address, source address, bytes)."""


class CudaError(RuntimeError):
    """A CUDA call failed; the message is CUDA's own (e.g. ``cudaErrorInvalidValue: invalid argument``)."""


class GpuUnavailable(FailedPrecondition):
    """This daemon cannot serve GPU regions (no cupy, no device, or ``gpu: off``); host regions still work."""


class CudaBackend(Protocol):
    """What the GPU data path needs from CUDA. Addresses are plain ints; streams and events are handles."""

    name: str

    def device_count(self) -> int: ...

    def device_uuid(self, device: int) -> bytes: ...

    def open_ipc(self, device: int, handle: bytes) -> tuple[int, int | None]:
        """Map another process's allocation; returns (base address, allocation size if known)."""
        ...

    def close_ipc(self, device: int, ptr: int) -> None: ...

    def host_register(self, ptr: int, size: int) -> None:
        """Page-lock existing host memory (the Cache arena) so DMA reads and writes it directly."""
        ...

    def host_unregister(self, ptr: int) -> None: ...

    def host_alloc(self, size: int) -> int:
        """Pinned host memory for bounce buffers."""
        ...

    def host_free(self, ptr: int) -> None: ...

    def create_stream(self, device: int) -> int: ...

    def destroy_stream(self, device: int, stream: int) -> None: ...

    def copy_async(self, device: int, stream: int, pieces: Sequence[Piece], to_device: bool) -> int:
        """Queue the copies on ``stream`` and record an event after them; returns the event."""
        ...

    def wait(self, device: int, event: int) -> None:
        """Block until ``event`` has completed, then destroy it; raises the copies' error if any."""
        ...


class CupyBackend:
    """:class:`CudaBackend` on ``cupy.cuda.runtime`` (plus libcuda for allocation sizes, when present)."""

    name = "cupy"

    def __init__(self) -> None:
        from cupy.cuda import runtime

        self._rt: Any = runtime
        self._libcuda = _libcuda()

    def _call(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self._rt, fn)(*args)
        except Exception as exc:  # cupy's CUDARuntimeError (and friends) without importing their types
            raise CudaError(f"{fn}: {exc}") from None

    def device_count(self) -> int:
        return int(self._call("getDeviceCount"))

    def device_uuid(self, device: int) -> bytes:
        # From the driver, as the client reads it: cupy's property copies the UUID as a C string and so
        # cuts it at its first zero byte.
        uuid = _driver_uuid(self._libcuda, device)
        if uuid:
            return uuid
        props = self._call("getDeviceProperties", device)
        return bytes(props.get("uuid", b""))

    def open_ipc(self, device: int, handle: bytes) -> tuple[int, int | None]:
        self._call("setDevice", device)
        ptr = int(self._call("ipcOpenMemHandle", handle))
        return ptr, _allocation_size(self._libcuda, ptr)

    def close_ipc(self, device: int, ptr: int) -> None:
        self._call("setDevice", device)
        self._call("ipcCloseMemHandle", ptr)

    def host_register(self, ptr: int, size: int) -> None:
        self._call("hostRegister", ptr, size, _HOST_PORTABLE)

    def host_unregister(self, ptr: int) -> None:
        self._call("hostUnregister", ptr)

    def host_alloc(self, size: int) -> int:
        return int(self._call("hostAlloc", size, _HOST_PORTABLE))

    def host_free(self, ptr: int) -> None:
        self._call("freeHost", ptr)

    def create_stream(self, device: int) -> int:
        self._call("setDevice", device)
        return int(self._call("streamCreateWithFlags", _STREAM_NON_BLOCKING))

    def destroy_stream(self, device: int, stream: int) -> None:
        self._call("setDevice", device)
        self._call("streamDestroy", stream)

    def copy_async(self, device: int, stream: int, pieces: Sequence[Piece], to_device: bool) -> int:
        self._call("setDevice", device)
        kind = _H2D if to_device else _D2H
        memcpy = self._rt.memcpyAsync
        try:
            for dst, src, n in pieces:
                memcpy(dst, src, n, kind, stream)
        except Exception as exc:
            raise CudaError(f"cudaMemcpyAsync: {exc}") from None
        # Blocking sync: the waiting thread sleeps instead of spinning a core for the copy's duration.
        event = int(self._call("eventCreateWithFlags", _EVENT_BLOCKING_SYNC | _EVENT_DISABLE_TIMING))
        self._call("eventRecord", event, stream)
        return event

    def wait(self, device: int, event: int) -> None:
        try:
            self._call("eventSynchronize", event)
        finally:
            self._call("eventDestroy", event)


def _libcuda() -> Any | None:
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
        fn = lib.cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return lib


def _driver_uuid(lib: Any | None, device: int) -> bytes:
    """The device's 16-byte UUID from the driver (``cuDeviceGetUuid_v2``), or b"" if unavailable."""
    if lib is None:
        return b""
    try:
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        cu_device = ctypes.c_int()
        if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(cu_device), device) != 0:
            return b""
        out = ctypes.create_string_buffer(16)
        for name in ("cuDeviceGetUuid_v2", "cuDeviceGetUuid"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
                return out.raw if fn(out, cu_device) == 0 else b""
    except (AttributeError, OSError):
        pass
    return b""


def _allocation_size(lib: Any | None, ptr: int) -> int | None:
    """Size of the allocation starting at ``ptr`` (so a region past its end is refused up front)."""
    if lib is None:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr) != 0:
        return None
    return int(size.value) - (ptr - int(base.value))


def load_backend() -> CudaBackend:
    """The cupy backend, or :class:`GpuUnavailable` saying exactly why not (no cupy / no device)."""
    if importlib.util.find_spec("cupy") is None:
        raise GpuUnavailable(
            "this daemon cannot open GPU regions: cupy is not installed; install the [gpu] extra "
            "(e.g. pip install cupy-cuda13x) or register host memory instead"
        )
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # installed but broken: a CUDA library or a dependency is missing
        cause = exc.__cause__ or exc
        raise GpuUnavailable(
            f"this daemon cannot open GPU regions: cupy is installed but does not load "
            f"({type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''})"
        ) from None
    try:
        backend = CupyBackend()
        count = backend.device_count()
    except (CudaError, ImportError) as exc:
        raise GpuUnavailable(f"this daemon cannot open GPU regions: no CUDA device ({exc})") from None
    if count < 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise GpuUnavailable(f"this daemon cannot open GPU regions: no CUDA device is visible{where}")
    return backend
