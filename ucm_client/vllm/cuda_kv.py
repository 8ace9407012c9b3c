"""vLLM's GPU KV cache as daemon regions: which bytes of which storage make up each block.

One job: the layout. Export (CUDA IPC) is :mod:`ucm_client.cuda_ipc`'s; the client registers each
storage through :meth:`UcmClient.register_cuda`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ucm_client.types import BlockIO, Segment

if TYPE_CHECKING:
    import torch

    from ucm_client.sync import UcmClient

__all__ = ["CudaKVCache"]


@dataclass(frozen=True, slots=True)
class _StoragePages:
    """Where one layer's block ``b`` lives on the GPU: ``start + b * stride`` inside CUDA storage ``storage``.

    Unlike the shared-memory ``kv_memory.LayerPages``, offsets count from the storage's own start (each
    storage is its own daemon region), so the storage travels with them.
    """

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
        self.layers: list[_StoragePages] = []
        by_ptr: dict[int, _StoragePages] = {}
        for t in self._tensors:
            storage_ptr = t.untyped_storage().data_ptr()
            self.storages.setdefault(storage_ptr, t)
            elem = t.element_size()
            start = t.data_ptr() - storage_ptr
            page = _StoragePages(storage_ptr, start, t.stride(0) * elem, t[0].numel() * elem)
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
