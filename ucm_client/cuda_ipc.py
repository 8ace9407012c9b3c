"""GPU memory as daemon regions: CUDA IPC exports of torch CUDA tensors or raw device pointers.

A vLLM worker registers each KV cache storage once with :meth:`UcmClient.register_cuda`; from then on
Load/Dump segments name byte offsets from the start of that storage, exactly as for a
:class:`~ucm_client.SharedBuffer`, and the daemon copies between its Cache and this GPU memory with
``cudaMemcpyAsync`` — no staging copy in this process, no bytes through gRPC.

Export works through the CUDA driver (``libcuda.so.1``, via ctypes), so the client needs neither cupy
nor a particular torch build: an IPC handle always names the start of a ``cudaMalloc`` allocation
(torch's caching allocator hands out pieces of larger segments), so the allocation is found with
``cuMemGetAddressRange`` and the region's offset inside it travels with the handle. Allocations made
with torch's ``expandable_segments`` (virtual memory management) cannot be shared this way; the error
says so.

Ordering is the caller's half of the contract (the daemon cannot see this process's streams):

* before a **dump**, call :func:`producers_done` (it records an event after the kernels queued so far
  on the current stream and waits for it), so the daemon never reads a block before it is written;
  or record a :class:`StreamMark` and submit the dump once it is ``ready()`` (no host stall, what the
  connector's per-layer dumps do);
* a **load** is complete when its task reports OK — the daemon has waited for its copies — so kernels
  launched after ``wait`` returns read the loaded bytes.

One job: export and ordering. vLLM's KV-cache layout is :mod:`ucm_client.vllm.cuda_kv`; torch is
imported only inside the functions that need it, so ``import ucm_client`` stays free of it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ucm_protocol.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    import torch

__all__ = [
    "IPC_HANDLE_BYTES",
    "CudaIpcExport",
    "CudaUnavailable",
    "StreamMark",
    "as_export",
    "export_pointer",
    "export_tensor",
    "producers_done",
]

IPC_HANDLE_BYTES = 64


class CudaUnavailable(FailedPrecondition):
    """GPU memory cannot be shared from this process (no CUDA device, no driver, CPU tensor...)."""


@dataclass(frozen=True, slots=True)
class CudaIpcExport:
    """What the daemon needs to open GPU memory: the allocation's IPC handle and where the region is."""

    handle: bytes
    """``cudaIpcMemHandle_t`` of the allocation holding the region (64 bytes)."""
    offset: int
    """Byte offset of the region's start inside that allocation."""
    size: int
    device: int
    """The device ordinal in this process."""
    device_uuid: bytes
    """The device's UUID (16 bytes): how the daemon finds the same GPU whatever its ordinal there."""
    base_ptr: int = 0
    """The region's device address in this process (segment offsets count from here)."""


# -- the CUDA driver, through ctypes -------------------------------------------------------------------
_lib: Any | None = None


def _driver() -> Any:
    global _lib
    if _lib is not None:
        return _lib
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise CudaUnavailable(
            f"no NVIDIA driver in this process ({name}: {exc}); GPU regions need one"
        ) from None
    u64, size_t, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
    lib.cuInit.argtypes = [ctypes.c_uint]
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(size_t), u64]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, u64]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
    lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
    lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
    lib.cuCtxPushCurrent_v2.argtypes = [vp]
    lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    _check(lib, lib.cuInit(0), "cuInit")
    _lib = lib
    return lib


def _check(lib: Any, result: int, what: str) -> None:
    if result == 0:
        return
    name = ctypes.c_char_p()
    lib.cuGetErrorName(result, ctypes.byref(name))
    text = name.value.decode() if name.value else f"CUresult {result}"
    if what == "cuIpcGetMemHandle" and text == "CUDA_ERROR_NOT_SUPPORTED":
        text += " (memory from torch's expandable_segments cannot be shared by IPC; unset it)"
    raise CudaUnavailable(f"{what} failed: {text}")


@contextlib.contextmanager
def _context(lib: Any, device: int) -> Iterator[int]:
    """Run driver calls in ``device``'s primary context (the one torch uses), whatever thread we are on."""
    cu_device = ctypes.c_int()
    _check(lib, lib.cuDeviceGet(ctypes.byref(cu_device), device), "cuDeviceGet")
    current, current_device = ctypes.c_void_p(), ctypes.c_int(-1)
    lib.cuCtxGetCurrent(ctypes.byref(current))
    same = current.value and lib.cuCtxGetDevice(ctypes.byref(current_device)) == 0
    if same and current_device.value == cu_device.value:
        yield cu_device.value
        return
    primary = ctypes.c_void_p()
    _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), cu_device), "cuDevicePrimaryCtxRetain")
    try:
        _check(lib, lib.cuCtxPushCurrent_v2(primary), "cuCtxPushCurrent")
        try:
            yield cu_device.value
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(cu_device)


def _device_uuid(lib: Any, cu_device: int) -> bytes:
    out = ctypes.create_string_buffer(16)
    for name in ("cuDeviceGetUuid_v2", "cuDeviceGetUuid"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
            _check(lib, fn(out, cu_device), name)
            return out.raw
    return b""


def export_pointer(ptr: int, size: int, device: int) -> CudaIpcExport:
    """Export ``size`` bytes of device memory at ``ptr`` (on ``device``, this process's ordinal)."""
    if size <= 0:
        raise InvalidArgument(f"region size must be positive, got {size}")
    lib = _driver()
    with _context(lib, device) as cu_device:
        base, alloc = ctypes.c_uint64(), ctypes.c_size_t()
        _check(
            lib,
            lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(alloc), ptr),
            "cuMemGetAddressRange",
        )
        if ptr + size > base.value + alloc.value:
            raise InvalidArgument(
                f"GPU region of {size} bytes at {ptr:#x} runs past its allocation "
                f"({base.value:#x} + {alloc.value} bytes)"
            )
        handle = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        _check(lib, lib.cuIpcGetMemHandle(handle, base.value), "cuIpcGetMemHandle")
        uuid = _device_uuid(lib, cu_device)
    return CudaIpcExport(handle.raw, ptr - base.value, size, device, uuid, ptr)


def export_tensor(tensor: torch.Tensor) -> CudaIpcExport:
    """Export the whole storage under a torch CUDA tensor (segment offsets count from its start)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgument(
            f"register_cuda needs a torch CUDA tensor or a CudaIpcExport, got {type(tensor)!r}"
        )
    if tensor.device.type != "cuda":
        raise CudaUnavailable(
            f"register_cuda needs a CUDA tensor, got one on {tensor.device}; register host memory "
            "with register(SharedBuffer) instead"
        )
    if not torch.cuda.is_available():
        raise CudaUnavailable("torch.cuda is not available in this process: no CUDA device to share")
    storage = tensor.untyped_storage()
    device = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return export_pointer(storage.data_ptr(), storage.nbytes(), device)


def as_export(target: Any) -> CudaIpcExport:
    """A :class:`CudaIpcExport` as is, or the export of a torch CUDA tensor."""
    if isinstance(target, CudaIpcExport):
        return target
    try:
        import torch
    except ImportError:
        raise CudaUnavailable(
            "register_cuda of a tensor needs torch with CUDA; pass a CudaIpcExport (export_pointer) otherwise"
        ) from None
    if not torch.cuda.is_available():
        raise CudaUnavailable("torch.cuda is not available in this process: no CUDA device to share")
    return export_tensor(target)


def producers_done(device: Any = None) -> None:
    """Wait until the kernels queued so far on the current stream are done (call before a dump).

    An event recorded after them and waited for: only this stream's work, not the whole device."""
    import torch

    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    event.synchronize()


class StreamMark:
    """An event recorded after the kernels queued so far on the current stream.

    ``producers_done`` without the wait: a layer's dump may be submitted once ``ready()`` says that
    layer's kernels finished, while the host keeps launching the next layers; ``wait()`` blocks.
    """

    def __init__(self, device: Any = None) -> None:
        import torch

        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(torch.cuda.current_stream(device))

    def ready(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        self._event.synchronize()
