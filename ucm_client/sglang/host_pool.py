"""SGLang's host KV pool as the daemon sees it: each page's byte ranges, and the pool in shared memory.

SGLang keeps its L2 cache in one host tensor (``host_pool.kv_buffer``) and names a page by the pool
index of its first token. Where that page's bytes lie depends on the layout; SGLang says so itself
(``get_page_buffer_meta``: its pointers and sizes for the pages of some indices). ``PoolPages`` asks
it once, for the first two pages, and keeps the answer as a template: every byte range of a page
starting at token ``t`` is ``start + t * per_token`` for ``length`` bytes. The ranges are kept in
address order, which is also the order of SGLang's flat page (``get_data_page(flat=True)`` slices
the pool along one dimension), so a page stored from the pool (``batch_set_v1``) and one stored from
a flat page (``batch_set``) hold the same bytes and either path reads what the other wrote.

The daemon copies only into memory it was handed as a sealed memfd. SGLang allocates its pool as an
anonymous mapping of its own (``alloc_mmap``), page-aligned and exactly the pool's size.
:func:`share_in_place` replaces that mapping, at the same addresses, with a ``SharedBuffer`` holding
the same bytes (``mmap(MAP_FIXED)`` over it): every view, pointer table and kernel argument SGLang
took keeps pointing at the same memory, which is now the daemon's to copy into. When the pool is
not such a mapping (another allocator, or pinned for CUDA, whose registration covers the old
pages), it is not touched and pages go through a staging buffer instead (``staging``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ucm_client.buffers import SharedBuffer

__all__ = ["SUPPORTED_LAYOUTS", "PageTemplate", "PoolPages", "share_in_place"]

SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
"""Host pool layouts whose page is a fixed set of byte ranges SGLang's CPU path can fill."""

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_CUDA_REGISTERED = "_sglang_cuda_host_registered_ranges"
"""Where SGLang records the ranges it pinned with ``cudaHostRegister`` (on the pool tensor)."""


class LayoutError(ValueError):
    """A host pool this backend cannot store: its layout or kind, named."""


@dataclass(frozen=True, slots=True)
class PageTemplate:
    """A page's byte ranges, in address order: range ``j`` of the page at token ``t`` starts at
    ``starts[j] + t * per_token[j]`` bytes into the pool and is ``lengths[j]`` bytes long."""

    starts: np.ndarray[Any, np.dtype[np.int64]]
    per_token: np.ndarray[Any, np.dtype[np.int64]]
    lengths: np.ndarray[Any, np.dtype[np.int64]]

    @property
    def page_bytes(self) -> int:
        return int(self.lengths.sum())


def _meta(host_pool: Any, first_token: int) -> tuple[list[int], list[int]]:
    import torch

    indices = torch.arange(first_token, first_token + host_pool.page_size, dtype=torch.int64)
    ptrs, sizes = host_pool.get_page_buffer_meta(indices)
    return [int(p) for p in ptrs], [int(s) for s in sizes]


def page_template(host_pool: Any) -> PageTemplate:
    """Ask SGLang where the first two pages' bytes are, and derive every page's from them."""
    page_size = int(host_pool.page_size)
    base = int(host_pool.kv_buffer.data_ptr())
    ptrs0, sizes0 = _meta(host_pool, 0)
    ptrs1, sizes1 = _meta(host_pool, page_size)
    if sizes0 != sizes1 or len(ptrs0) != len(ptrs1):
        raise LayoutError(
            f"host pool layout {host_pool.layout!r}: pages differ in shape ({sizes0} vs {sizes1})"
        )
    starts = np.array(ptrs0, dtype=np.int64) - base
    steps = np.array(ptrs1, dtype=np.int64) - np.array(ptrs0, dtype=np.int64)
    if (steps % page_size).any():
        raise LayoutError(f"host pool layout {host_pool.layout!r}: a page does not start at a token boundary")
    order = np.argsort(starts, kind="stable")
    starts, per_token, lengths = starts[order], (steps // page_size)[order], np.array(sizes0, np.int64)[order]
    # Adjacent ranges (one layer after the other inside a page) move as one.
    merged: list[list[int]] = []
    for s, p, n in zip(starts.tolist(), per_token.tolist(), lengths.tolist(), strict=True):
        if merged and merged[-1][0] + merged[-1][2] == s and merged[-1][1] == p:
            merged[-1][2] += n
        else:
            merged.append([s, p, n])
    table = np.array(merged, dtype=np.int64).reshape(-1, 3)
    return PageTemplate(table[:, 0].copy(), table[:, 1].copy(), table[:, 2].copy())


class PoolPages:
    """Where each page of an SGLang host pool lies, checked against the pool's own geometry."""

    def __init__(self, host_pool: Any) -> None:
        layout = str(getattr(host_pool, "layout", ""))
        if layout not in SUPPORTED_LAYOUTS:
            raise LayoutError(
                f"UCM's SGLang backend stores host pools laid out as {', '.join(SUPPORTED_LAYOUTS)}; "
                f"this one is {layout!r} (set --hicache-mem-layout to one of them)"
            )
        kv = getattr(host_pool, "kv_buffer", None)
        if kv is None or not hasattr(host_pool, "get_page_buffer_meta"):
            raise LayoutError(
                f"UCM's SGLang backend stores MHA and MLA KV host pools; {type(host_pool).__name__} "
                "has no single KV buffer"
            )
        if kv.device.type != "cpu" or not kv.is_contiguous():
            raise LayoutError(
                f"the host KV pool must be one contiguous CPU tensor (got {kv.device}, {kv.stride()})"
            )
        self.host_pool = host_pool
        self.layout = layout
        self.page_size = int(host_pool.page_size)
        self.size = int(host_pool.size)
        """Tokens the pool holds (host indices run 0..size-1)."""
        self.base = int(kv.data_ptr())
        self.nbytes = int(kv.numel() * kv.element_size())
        self.template = page_template(host_pool)
        flat = host_pool.get_data_page(0, flat=True)  # a view: no allocation (nor pinning)
        self.flat_page_bytes = int(flat.numel() * flat.element_size())
        if self.template.page_bytes != self.flat_page_bytes:
            raise LayoutError(
                f"host pool layout {layout!r}: a page's byte ranges hold {self.template.page_bytes} bytes, "
                f"SGLang's flat page {self.flat_page_bytes}"
            )

    @property
    def page_bytes(self) -> int:
        return self.template.page_bytes

    @property
    def ranges_per_page(self) -> int:
        return len(self.template.starts)

    def page_starts(self, host_indices: Any, num_pages: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The first token of each of ``num_pages`` pages, after checking ``host_indices`` name exactly
        those pages, whole and inside the pool (a ``ValueError`` naming what is wrong otherwise)."""
        import torch

        if not isinstance(host_indices, torch.Tensor):
            raise TypeError(f"host_indices must be a torch tensor, got {type(host_indices).__name__}")
        expected = num_pages * self.page_size
        if host_indices.numel() != expected:
            raise ValueError(
                f"host_indices holds {host_indices.numel()} token indices for {num_pages} keys; "
                f"expected {expected} (page size {self.page_size})"
            )
        if num_pages == 0:
            return np.zeros(0, dtype=np.int64)
        idx = host_indices.detach().to("cpu", torch.int64).reshape(num_pages, self.page_size)
        first = idx[:, 0]
        low, high = int(idx.min()), int(idx.max())
        if low < 0 or high >= self.size:
            raise ValueError(
                f"host_indices out of the host pool: indices {low}..{high}, the pool holds tokens "
                f"0..{self.size - 1}"
            )
        if bool((first % self.page_size).ne(0).any()) or bool(
            (idx - first[:, None]).ne(torch.arange(self.page_size)).any()
        ):
            raise ValueError(
                "host_indices do not name whole pages (each page: page_size consecutive indices)"
            )
        return first.numpy().astype(np.int64)

    def ranges(self, page_starts: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Offsets (pages x ranges) into the pool and each range's length."""
        t = self.template
        return t.starts[None, :] + page_starts[:, None] * t.per_token[None, :], t.lengths


def _mapping_of(address: int) -> tuple[int, int] | None:
    """The ``[start, end)`` of the mapping holding ``address`` in this process, from /proc/self/maps."""
    with Path("/proc/self/maps").open() as maps:
        for line in maps:
            span = line.split(" ", 1)[0]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return lo, hi
    return None


def share_in_place(pages: PoolPages) -> SharedBuffer | str:
    """Put the pool's memory in a new ``SharedBuffer`` at the same addresses; or say why not.

    Only a pool that is exactly one mapping of its own is replaced (SGLang's ``alloc_mmap``), and only
    one SGLang did not pin with ``cudaHostRegister`` (a ``pin_memory`` pool on a host without CUDA
    was not pinned at all). Costs one copy of the pool (it may hold L2 pages already, when storage
    is attached at run time) and, for that moment, the pool's size in extra memory.
    """
    if getattr(pages.host_pool.kv_buffer, _CUDA_REGISTERED, None):
        return "the host pool is pinned for CUDA (its registration covers the pages it was allocated with)"
    length = -(-pages.nbytes // PAGE) * PAGE
    if pages.base % PAGE:
        return f"the host pool does not start on a memory page ({pages.base:#x})"
    span = _mapping_of(pages.base)
    if span != (pages.base, pages.base + length):
        return "the host pool is not a mapping of its own (allocated by another allocator)"
    buffer = SharedBuffer(length, label="sglang-host-pool")
    try:
        ctypes.memmove(ctypes.c_void_p(_address(buffer)), ctypes.c_void_p(pages.base), pages.nbytes)
        flags = mmap.MAP_SHARED | _MAP_FIXED
        got = _libc.mmap(pages.base, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, buffer.fileno(), 0)
        if got is None or got == _MAP_FAILED or got != pages.base:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap(MAP_FIXED) of the host pool failed: {os.strerror(err)}")
    except BaseException:
        buffer.close()
        raise
    # Map every page now, as SGLang's allocator had (MAP_POPULATE): no fault on the first access.
    _libc.madvise(pages.base, length, _MADV_POPULATE_WRITE)
    return buffer


def _address(buffer: SharedBuffer) -> int:
    return int(buffer.array().ctypes.data)
