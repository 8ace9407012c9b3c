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

:class:`LayerwiseLoad` (the connector's ``use_layerwise``) submits one task per layer at once and
waits per layer, so the copy of layer L+1 runs while layer L computes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ucm_client.types import BlockIO, Segment, TaskResult, key_digest
from ucm_protocol.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    import torch

    from ucm_client.sync import UcmClient

__all__ = [
    "CudaIpcExport",
    "CudaKVCache",
    "CudaUnavailable",
    "LayerwiseLoad",
    "StreamMark",
    "export_pointer",
    "export_tensor",
    "layer_key",
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


# -- vLLM's GPU KV cache --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _LayerPages:
    storage: int
    """data_ptr of the storage holding this layer (one region per storage)."""
    start: int
    """Offset of block 0's page from the storage's start."""
    stride: int
    length: int


class CudaKVCache:
    """vLLM's GPU KV cache as daemon regions: each storage registered once, each block's segments.

    What the connector's worker uses instead of the shared-memory staging buffer when vLLM runs on
    CUDA: ``register`` once (and again after a daemon restart, which the client does by itself), then
    ``segments(block_id)`` in Load/Dump. A block's bytes are every layer's page in address order, the
    layout the staging path (``ucm_client.vllm.staging``) stores, so blocks saved either way load the
    other way. Stored per layer (``use_layerwise``), one layer's object of a block is that layer's
    page alone (``layer_blocks``).
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        unique: dict[int, torch.Tensor] = {}
        for name, tensor in kv_caches.items():
            if not tensor[0].is_contiguous():
                raise RuntimeError(f"{name}: a block's page is not contiguous (strides {tensor.stride()})")
            unique.setdefault(tensor.data_ptr(), tensor)
        self._tensors = [unique[ptr] for ptr in sorted(unique)]
        self.storages: dict[int, torch.Tensor] = {}
        self.layers: list[_LayerPages] = []
        by_ptr: dict[int, _LayerPages] = {}
        for t in self._tensors:
            storage_ptr = t.untyped_storage().data_ptr()
            self.storages.setdefault(storage_ptr, t)
            elem = t.element_size()
            start = t.data_ptr() - storage_ptr
            page = _LayerPages(storage_ptr, start, t.stride(0) * elem, t[0].numel() * elem)
            self.layers.append(page)
            by_ptr[t.data_ptr()] = page
        self.pages_by_name = {name: by_ptr[t.data_ptr()] for name, t in kv_caches.items()}
        """Each layer name's pages (layers sharing one KV cache share the entry)."""
        self.num_blocks = min(t.shape[0] for t in self._tensors)
        self.block_bytes = sum(p.length for p in self.layers)
        self.regions: dict[int, int] = {}

    def register(self, client: UcmClient, *, label: str = "vllm-kv-cache") -> None:
        """Register every storage once (exported in this thread, where torch's CUDA context is)."""
        for storage_ptr, tensor in self.storages.items():
            if storage_ptr not in self.regions:
                self.regions[storage_ptr] = client.register_cuda(tensor, label=label)

    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside the KV cache (0..{self.num_blocks - 1})")

    def segments(self, block_id: int) -> tuple[Segment, ...]:
        """The byte ranges of block ``block_id``, adjacent pages of one storage merged."""
        self._check_block(block_id)
        out: list[Segment] = []
        for page in self.layers:
            region = self.regions[page.storage]
            offset = page.start + block_id * page.stride
            last = out[-1] if out else None
            if last is not None and last.region == region and last.offset + last.length == offset:
                out[-1] = Segment(region, last.offset, last.length + page.length)
            else:
                out.append(Segment(region, offset, page.length))
        return tuple(out)

    def blocks(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> list[BlockIO]:
        return [BlockIO(k, self.segments(b)) for k, b in zip(keys, block_ids, strict=True)]

    def layer_segments(self, layer_name: str, block_id: int) -> tuple[Segment, ...]:
        """Layer ``layer_name``'s page of block ``block_id``."""
        self._check_block(block_id)
        page = self.pages_by_name[layer_name]
        return (Segment(self.regions[page.storage], page.start + block_id * page.stride, page.length),)

    def layer_blocks(self, layer_name: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> list[BlockIO]:
        """One layer's objects of the blocks ``block_ids``, stored under ``keys`` (``layer_key``s)."""
        return [BlockIO(k, self.layer_segments(layer_name, b)) for k, b in zip(keys, block_ids, strict=True)]


# -- layerwise loads -------------------------------------------------------------------------------------
def layer_key(key: bytes, layer: int) -> bytes:
    """The key of one layer's part of a block, for layerwise dumps and loads."""
    return key_digest(key, "layer", layer)


class LayerwiseLoad:
    """One load task per layer, all submitted at once; :meth:`wait_layer` waits for one layer only.

    The daemon runs the tasks concurrently, so while the model computes layer L the copies of the
    following layers proceed; the forward calls ``wait_layer(L)`` right before layer L's attention.
    Blocks stored per layer (keys from :func:`layer_key`) make each layer its own small block.
    """

    def __init__(self, client: UcmClient, namespace: bytes, per_layer: Sequence[Sequence[BlockIO]]) -> None:
        self._client = client
        self.tasks = [client.load(namespace, list(blocks)) if blocks else None for blocks in per_layer]
        self.results: dict[int, TaskResult] = {}

    def wait_layer(self, layer: int, timeout_s: float) -> TaskResult | None:
        """Layer ``layer``'s result (``None`` if it had no blocks); cancels it if it times out."""
        if layer in self.results:
            return self.results[layer]
        task = self.tasks[layer]
        if task is None:
            return None
        result = self._client.wait(task, timeout_s, cancel_on_timeout=True)
        self.results[layer] = result
        return result

    def wait_all(self, timeout_s: float) -> list[TaskResult | None]:
        return [self.wait_layer(layer, timeout_s) for layer in range(len(self.tasks))]
