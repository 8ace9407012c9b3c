"""A shared-memory bounce buffer for KV caches the daemon cannot map (GPU memory, or zero-copy off).

The daemon copies only between its tiers and registered host memory. When vLLM's KV cache is not in
such memory (CUDA, where ``ucm_client`` has no CUDA IPC regions yet), blocks go through a fixed pool
of slots in one ``SharedBuffer``: a load lands in slots and is then copied into the KV cache; a save
is copied out of the KV cache into slots first (so vLLM may reuse its blocks at once) and dumped
from there. A slot holds one block laid out exactly as the zero-copy path stores it (every layer's
page in address order), so blocks saved by either path load in the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ucm_client import Segment, SharedBuffer

__all__ = ["StagingArea"]


class StagingArea:
    """``num_slots`` block-sized slots of shared memory, and copies between them and the KV cache."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], buffer_bytes: int):
        unique: dict[int, torch.Tensor] = {}
        for name, tensor in kv_caches.items():
            if not tensor[0].is_contiguous():
                raise RuntimeError(f"{name}: a block's page is not contiguous (strides {tensor.stride()})")
            unique.setdefault(tensor.data_ptr(), tensor)
        self._layers = [unique[ptr] for ptr in sorted(unique)]
        self._pages = [t[0].numel() * t.element_size() for t in self._layers]
        self.block_bytes = sum(self._pages)
        self.num_blocks = min(t.shape[0] for t in self._layers)
        self.num_slots = buffer_bytes // self.block_bytes
        if self.num_slots < 1:
            raise RuntimeError(
                f"staging buffer of {buffer_bytes} bytes cannot hold one {self.block_bytes}-byte block"
            )
        self.buffer = SharedBuffer(self.num_slots * self.block_bytes)
        self._host = torch.frombuffer(self.buffer.buf, dtype=torch.uint8, count=self.buffer.size)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._device = self._layers[0].device

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self, count: int) -> list[int] | None:
        """``count`` free slots, or None if the pool is short (the caller skips or recomputes)."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def release(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    def segments(self, region: int, slot: int) -> tuple[Segment, ...]:
        return (Segment(region, slot * self.block_bytes, self.block_bytes),)

    def _pieces(self, slot: int, block_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside the KV cache (0..{self.num_blocks - 1})")
        pieces = []
        offset = slot * self.block_bytes
        for layer, page in zip(self._layers, self._pages, strict=True):
            device_page = layer[block_id].view(torch.uint8).reshape(-1)
            pieces.append((device_page, self._host[offset : offset + page]))
            offset += page
        return pieces

    def to_kv(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy loaded slots into vLLM's blocks (and wait, so the forward sees them)."""
        for slot, block_id in zip(slots, block_ids, strict=True):
            for device_page, host_page in self._pieces(slot, block_id):
                device_page.copy_(host_page, non_blocking=True)
        self._sync()

    def from_kv(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy vLLM's blocks into slots (and wait, so the daemon reads finished bytes)."""
        for slot, block_id in zip(slots, block_ids, strict=True):
            for device_page, host_page in self._pieces(slot, block_id):
                host_page.copy_(device_page, non_blocking=True)
        self._sync()

    def slot_bytes(self, slot: int) -> bytes:
        return bytes(self.buffer.buf[slot * self.block_bytes : (slot + 1) * self.block_bytes])

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()
