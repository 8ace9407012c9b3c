"""A shared-memory bounce buffer for KV caches the daemon cannot map (GPU memory, or zero-copy off).

The daemon copies only between its tiers and registered host memory. When vLLM's KV cache is not in
such memory (CUDA, where ``ucm_client`` has no CUDA IPC regions yet), blocks go through the slots of
the client's one :class:`~ucm_client.mover.BlockMover`: a load lands in slots and is then copied into
the KV cache; a save is copied out of the KV cache into slots first (so vLLM may reuse its blocks at
once) and dumped from there. A slot holds one block laid out exactly as the zero-copy path stores it
(every layer's page in address order), so blocks saved by either path load in the other. The worker
sends and waits for the tasks itself (its loads and saves are polled across steps).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ucm_client import Segment, SharedBuffer
from ucm_client.mover import BlockMover

__all__ = ["StagingArea"]


class StagingArea:
    """Block-sized slots of a :class:`BlockMover`, and which KV pages make up a block."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], buffer_bytes: int):
        unique: dict[int, torch.Tensor] = {}
        for name, tensor in kv_caches.items():
            if not tensor[0].is_contiguous():
                raise RuntimeError(f"{name}: a block's page is not contiguous (strides {tensor.stride()})")
            unique.setdefault(tensor.data_ptr(), tensor)
        self._layers = [unique[ptr] for ptr in sorted(unique)]
        self.block_bytes = sum(t[0].numel() * t.element_size() for t in self._layers)
        self.num_blocks = min(t.shape[0] for t in self._layers)
        num_slots = buffer_bytes // self.block_bytes
        if num_slots < 1:
            raise RuntimeError(
                f"staging buffer of {buffer_bytes} bytes cannot hold one {self.block_bytes}-byte block"
            )
        self.mover = BlockMover(self.block_bytes, num_slots, label="vllm-kv-staging")

    @property
    def num_slots(self) -> int:
        return self.mover.num_slots

    @property
    def buffer(self) -> SharedBuffer:
        return self.mover.buffer

    @property
    def free_slots(self) -> int:
        return self.mover.free_slots

    def acquire(self, count: int) -> list[int] | None:
        """``count`` free slots, or None if the pool is short (the caller skips or recomputes)."""
        return self.mover.acquire(count)

    def release(self, slots: Sequence[int]) -> None:
        self.mover.release(slots)

    def segments(self, region: int, slot: int) -> tuple[Segment, ...]:
        return self.mover.segments(region, slot)

    def _pages(self, block_id: int) -> list[torch.Tensor]:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside the KV cache (0..{self.num_blocks - 1})")
        return [layer[block_id] for layer in self._layers]

    def to_kv(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy loaded slots into vLLM's blocks (and wait, so the forward sees them)."""
        self.mover.copy_out(slots, [self._pages(b) for b in block_ids])

    def from_kv(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy vLLM's blocks into slots (and wait, so the daemon reads finished bytes)."""
        self.mover.copy_in(slots, [self._pages(b) for b in block_ids])

    def slot_bytes(self, slot: int) -> bytes:
        return bytes(self.mover.slot(slot).numpy())
