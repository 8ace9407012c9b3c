"""vLLM's CPU KV cache placed in shared memory the daemon can copy into, and each block's byte ranges.

On CPU, vLLM allocates the KV cache of all layers as one raw ``int8`` buffer and views each layer as
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` inside it. If that buffer *is* a
registered ``SharedBuffer``, the daemon copies tier bytes straight into the pages vLLM computes on,
and dumps straight out of them: no staging copy on either side.

Two ways to get there, tried in order:

1. ``ShmAllocation`` is returned from the connector's ``get_mem_pool_context``: vLLM runs its KV
   allocation inside it, and the one ``torch.zeros`` it issues is answered with a tensor over a
   fresh ``SharedBuffer`` (a ``TorchFunctionMode``, torch's supported hook for factory calls).
2. If the allocation happened elsewhere (another vLLM version), ``adopt`` copies the current
   contents into a ``SharedBuffer`` once and re-points every tensor viewing the old storage
   (``Tensor.set_``), both the connector's views and the ones bound to attention layers.

A fresh ``SharedBuffer`` has every page allocated but none mapped into this process: vLLM's own
``torch.zeros`` would have touched (and so mapped) every page, while ours touches none, so the first
forward reading a block the daemon loaded paid a page fault per 4 KiB (64 KiB with the kernel's
fault-around) of it: about 2,300 faults and 7 ms of a 4,000-token warm prefill.
``populate`` maps the whole buffer once at allocation instead, as the ``torch.zeros`` would have.

Either way ``KVMemory`` then checks that every layer tensor lies inside the shared buffer before
anything is registered, so a silent fallback to a private copy cannot happen.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ucm_client import Segment, SharedBuffer
from ucm_client.vllm.config import LOGGER_NAME

__all__ = ["KVMemory", "LayerPages", "ShmAllocation", "adopt", "populate", "state_pages"]

logger = logging.getLogger(LOGGER_NAME)

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate(tensor: torch.Tensor) -> None:
    """Map every page of a CPU tensor over shared memory into this process's page tables now.

    One ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+; it drops the GIL) maps pages that exist
    already (a ``SharedBuffer`` allocates them all): nothing is allocated or written. Older kernels
    write one zero byte per page instead (the buffer reads as zeros, so nothing changes).
    """
    start = tensor.data_ptr()
    aligned = start - start % PAGE
    length = tensor.numel() * tensor.element_size() + (start - aligned)
    if _libc.madvise(aligned, length, MADV_POPULATE_WRITE) == 0:
        return
    flat = tensor.view(torch.int8).reshape(-1)
    flat[(PAGE - start % PAGE) % PAGE :: PAGE].zero_()


class ShmAllocation(TorchFunctionMode):
    """Answer the first large CPU ``int8`` ``torch.zeros`` inside the context from shared memory."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer: SharedBuffer | None = None
        self.tensor: torch.Tensor | None = None

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.buffer is None and func is torch.zeros and self._is_kv_allocation(args, kwargs):
            size = int(args[0] if not isinstance(args[0], list | tuple) else args[0][0])
            self.buffer = SharedBuffer(size)
            # A fresh SharedBuffer (a memfd, every page allocated up front) reads as zeros, which is
            # what torch.zeros promises.
            self.tensor = torch.frombuffer(self.buffer.buf, dtype=torch.int8, count=size)
            populate(self.tensor)
            return self.tensor
        return func(*args, **kwargs)

    @staticmethod
    def _is_kv_allocation(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if len(args) != 1 or kwargs.get("dtype") is not torch.int8:
            return False
        device = torch.device(kwargs.get("device") or "cpu")
        shape = args[0]
        one_dim = isinstance(shape, int) or (isinstance(shape, list | tuple) and len(shape) == 1)
        return device.type == "cpu" and one_dim


def _storage_span(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def adopt(kv_caches: Mapping[str, torch.Tensor], layers: Iterable[Any]) -> tuple[SharedBuffer, torch.Tensor]:
    """Move an already-allocated CPU KV cache into a new ``SharedBuffer``; return it and its tensor.

    ``layers`` are vLLM's attention layers (``static_forward_context`` values): their bound
    ``kv_cache`` tensors may be separate view objects and are re-pointed too.
    """
    spans = {_storage_span(t) for t in kv_caches.values()}
    if len(spans) != 1:
        raise RuntimeError(f"expected one KV storage shared by all layers, found {len(spans)}")
    (old_ptr, nbytes) = spans.pop()
    buffer = SharedBuffer(nbytes)
    raw = torch.frombuffer(buffer.buf, dtype=torch.int8, count=nbytes)
    first = next(iter(kv_caches.values()))
    old = torch.empty(0, dtype=torch.int8).set_(first.untyped_storage(), 0, (nbytes,), (1,))
    raw.copy_(old)
    new_storage = raw.untyped_storage()
    seen: set[int] = set()
    candidates = list(kv_caches.values())
    for layer in layers:
        kv = getattr(layer, "kv_cache", None)
        items = kv if isinstance(kv, list | tuple) else [kv]
        candidates.extend(t for t in items if isinstance(t, torch.Tensor))
    for tensor in candidates:
        if id(tensor) in seen or tensor.untyped_storage().data_ptr() != old_ptr:
            continue
        seen.add(id(tensor))
        tensor.set_(new_storage, tensor.storage_offset(), tensor.size(), tensor.stride())
    return buffer, raw


def state_pages(states: Any) -> torch.Tensor:
    """One ``int8`` view ``[num_blocks, page]`` over a Mamba layer's state tensors.

    vLLM hands a Mamba / linear-attention layer's KV cache as several tensors (conv state, SSM
    state), each ``[num_blocks, ...]`` over the same pages: block ``b`` of each lies at the same page
    stride, one after the other. The view spans each page from the first state's start to the last
    state's end, so a block's state moves as the bytes of one page, like an attention layer's KV.
    """
    tensors = [t for t in states if isinstance(t, torch.Tensor)]
    if not tensors or len(tensors) != len(states):
        raise RuntimeError(f"expected a list of state tensors, got {type(states).__name__}")
    strides = {t.stride(0) * t.element_size() for t in tensors}
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    if len(strides) != 1 or len(storages) != 1:
        raise RuntimeError(f"state tensors do not share one page layout (strides {sorted(strides)})")
    stride = strides.pop()
    base = min(t.data_ptr() for t in tensors)
    span = max(t.data_ptr() - base + t[0].numel() * t.element_size() for t in tensors)
    if span > stride or not all(t[0].is_contiguous() for t in tensors):
        raise RuntimeError(f"state tensors overlap the next page (span {span} bytes, page stride {stride})")
    storage = tensors[0].untyped_storage()
    num_blocks = min(t.shape[0] for t in tensors)
    offset = base - storage.data_ptr()
    view = torch.empty(0, dtype=torch.int8, device=tensors[0].device)
    return view.set_(storage, offset, (num_blocks, span), (stride, 1))


@dataclass(frozen=True, slots=True)
class LayerPages:
    """Where one layer's block ``b`` lives: ``start + b * stride`` for ``length`` bytes."""

    start: int
    stride: int
    length: int


class KVMemory:
    """The shared buffer holding vLLM's KV cache, and the segments making up each block's bytes.

    A block's stored bytes are its pages of every layer, in address order (deterministic for a
    given layout, which is part of the namespace). Adjacent pages merge into one segment, so a
    block-outermost layout yields one segment per block. Stored per layer (``use_layerwise``), a
    block's object for one layer is just that layer's page (``layer_segments``).
    """

    def __init__(self, buffer: SharedBuffer, raw: torch.Tensor, kv_caches: Mapping[str, torch.Tensor]):
        self.buffer = buffer
        self.raw = raw
        self.base = raw.data_ptr()
        pages: dict[int, LayerPages] = {}
        self.pages_by_name: dict[str, LayerPages] = {}
        """Each layer name's pages (layers sharing one KV cache share the entry)."""
        for name, tensor in kv_caches.items():
            elem = tensor.element_size()
            start = tensor.data_ptr() - self.base
            length = tensor[0].numel() * elem
            if not tensor[0].is_contiguous():
                raise RuntimeError(f"{name}: a block's page is not contiguous (strides {tensor.stride()})")
            end = start + (tensor.shape[0] - 1) * tensor.stride(0) * elem + length
            if start < 0 or end > buffer.size:
                raise RuntimeError(
                    f"{name}: KV cache tensor is not inside the shared buffer "
                    f"(offset {start}..{end}, buffer {buffer.size} bytes)"
                )
            page = LayerPages(start, tensor.stride(0) * elem, length)
            if (known := pages.get(start)) is not None and known.length >= length:
                page = known  # layers sharing a page (a Mamba layer's state may use less of it)
            pages[start] = page
            self.pages_by_name[name] = page
        self.pages_by_name = {name: pages[p.start] for name, p in self.pages_by_name.items()}
        self.layers = [pages[k] for k in sorted(pages)]
        self.num_blocks = min(t.shape[0] for t in kv_caches.values())
        self.block_bytes = sum(p.length for p in self.layers)

    def segment_of(self, layer_name: str) -> int | None:
        """Which segment of every block (``segments``) holds layer ``layer_name``'s page: its place
        among the pages in address order, when no two pages of a block ever merge (layer-major
        layouts: equal strides, pages apart); None otherwise (then a block's segments do not follow
        its layers, and nothing can be read before the whole block is in)."""
        page = self.pages_by_name.get(layer_name)
        if page is None:
            return None
        for a, b in zip(self.layers, self.layers[1:], strict=False):
            if a.stride != b.stride or a.start + a.length == b.start:
                return None
        return self.layers.index(page)

    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside the KV cache (0..{self.num_blocks - 1})")

    def segments(self, region: int, block_id: int) -> tuple[Segment, ...]:
        """The byte ranges of block ``block_id`` in registered region ``region``, merged."""
        self._check_block(block_id)
        out: list[Segment] = []
        for page in self.layers:
            offset = page.start + block_id * page.stride
            if out and out[-1].offset + out[-1].length == offset:
                last = out.pop()
                out.append(Segment(region, last.offset, last.length + page.length))
            else:
                out.append(Segment(region, offset, page.length))
        return tuple(out)

    def layer_segments(self, region: int, layer_name: str, block_id: int) -> tuple[Segment, ...]:
        """Layer ``layer_name``'s page of block ``block_id``: one layer's object of a layerwise block."""
        self._check_block(block_id)
        page = self.pages_by_name[layer_name]
        return (Segment(region, page.start + block_id * page.stride, page.length),)

    def block_view(self, block_id: int) -> bytes:
        """A copy of a block's bytes as the daemon stores them (for tests and diagnostics)."""
        mem = self.buffer.buf
        return b"".join(
            bytes(mem[p.start + block_id * p.stride : p.start + block_id * p.stride + p.length])
            for p in self.layers
        )
