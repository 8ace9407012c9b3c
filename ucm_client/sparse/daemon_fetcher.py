"""ESA's :class:`~ucm_client.sparse.esa_offload.BlockFetcher` over a real ``ucm-server``.

Each block of a request is one stored block: its keys then its values (``[block_size, kv_heads,
head_dim]`` each, in the tensors' dtype), under a 32-byte key derived from the request's own key
and the block index. ``fetch`` turns every block ESA selected and does not hold into one Load task
into a registered shared buffer — the daemon copies straight into it — and returns tensors copied
out of that buffer (it is reused by the next fetch). Blocks the daemon lacks or fails are left out
of the answer, which ESA reports as missing; nothing is invented.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ucm_client.buffers import SharedBuffer
from ucm_client.sparse.esa_offload import BlockKV
from ucm_client.sync import UcmClient
from ucm_client.types import BlockIO, BlockState, Segment, key_digest

__all__ = ["DaemonBlockFetcher"]


class DaemonBlockFetcher:
    """Fetch ESA's selected blocks of one request from the daemon, in one batched Load per call."""

    def __init__(
        self,
        client: UcmClient,
        namespace: bytes,
        request_key: bytes,
        *,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        max_blocks: int = 64,
        timeout_s: float = 30.0,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.request_key = request_key
        self.shape = (block_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.half = block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        self.max_blocks = max_blocks
        self.timeout_s = timeout_s
        self._buffer = SharedBuffer(max_blocks * 2 * self.half, label="esa-fetch")
        self._region = client.register(self._buffer)
        self._view = self._buffer.torch()
        self.calls = 0
        self.blocks_served = 0

    def key(self, block_id: int) -> bytes:
        return key_digest(self.request_key, "esa-block", block_id)

    def store(self, blocks: Mapping[int, BlockKV]) -> None:
        """Dump blocks (e.g. at prefill) through the same buffer, ``max_blocks`` at a time."""
        items = list(blocks.items())
        for start in range(0, len(items), self.max_blocks):
            batch = items[start : start + self.max_blocks]
            ios = []
            for slot, (block_id, kv) in enumerate(batch):
                base = slot * 2 * self.half
                self._bytes(base).copy_(kv.keys.contiguous().view(torch.uint8).reshape(-1))
                self._bytes(base + self.half).copy_(kv.values.contiguous().view(torch.uint8).reshape(-1))
                ios.append(BlockIO(self.key(block_id), (Segment(self._region, base, 2 * self.half),)))
            result = self.client.wait(self.client.dump(self.namespace, ios), self.timeout_s)
            if not result.ok:
                raise RuntimeError(f"storing ESA blocks failed: {result.reasons}")

    def fetch(self, block_ids: Sequence[int]) -> Mapping[int, BlockKV]:
        self.calls += 1
        out: dict[int, BlockKV] = {}
        for start in range(0, len(block_ids), self.max_blocks):
            batch = list(block_ids[start : start + self.max_blocks])
            ios = [
                BlockIO(self.key(b), (Segment(self._region, slot * 2 * self.half, 2 * self.half),))
                for slot, b in enumerate(batch)
            ]
            result = self.client.wait(self.client.load(self.namespace, ios), self.timeout_s)
            for slot, (block_id, state) in enumerate(zip(batch, result.states, strict=True)):
                if state is not BlockState.OK:
                    continue  # missing or failed: ESA reports it, the attention leaves it out
                base = slot * 2 * self.half
                out[block_id] = BlockKV(self._tensor(base), self._tensor(base + self.half))
        self.blocks_served += len(out)
        return out

    def close(self) -> None:
        self.client.unregister(self._region)
        del self._view
        self._buffer.close()

    def _bytes(self, offset: int) -> torch.Tensor:
        return self._view[offset : offset + self.half]

    def _tensor(self, offset: int) -> torch.Tensor:
        return self._bytes(offset).clone().view(self.dtype).reshape(self.shape)
