"""ESA over a request whose KV mostly lives in the UCM daemon: fetch only the selected blocks.

On a long context only a few blocks stay resident next to the attention kernel (the initial and
local windows, plus whatever was fetched recently); every full block's representative stays resident
too, since representatives are what retrieval reads and they are ``block_size`` times smaller than
the block. At each decode step ESA selects blocks from the representatives; the selected blocks that
are not resident are fetched in one batched call through a :class:`BlockFetcher`, which
:class:`~ucm_client.sparse.daemon_fetcher.DaemonBlockFetcher` implements over ``UcmClient.load``. A
block the store cannot return is reported in the step's result (missing is a value) and left out of
the attention, never silently replaced.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ucm_client.sparse.block_sparse import BlockSparseMethod, DecodeState
from ucm_client.sparse.kernels import dense_decode_attention

__all__ = ["BlockFetcher", "BlockKV", "InMemoryBlockFetcher", "OffloadedDecodeResult", "OffloadedSequence"]


@dataclass(frozen=True, slots=True)
class BlockKV:
    """One block's keys and values, ``[block_size, num_kv_heads, head_dim]`` each, token-major."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@runtime_checkable
class BlockFetcher(Protocol):
    """Where non-resident blocks come from (the daemon, through the connector).

    ``fetch`` is one batched request for all ``block_ids``; ids it cannot serve are simply absent
    from the returned mapping.
    """

    def fetch(self, block_ids: Sequence[int]) -> Mapping[int, BlockKV]: ...


@dataclass(slots=True)
class InMemoryBlockFetcher:
    """A :class:`BlockFetcher` over a dict held in this process, counting what it serves.

    A real store, just not a remote one: tests and the benchmark use it to check what ESA asks for.
    """

    blocks: dict[int, BlockKV] = field(default_factory=dict)
    calls: int = 0
    blocks_served: int = 0
    bytes_served: int = 0
    requested: list[list[int]] = field(default_factory=list)

    def put(self, block_id: int, kv: BlockKV) -> None:
        self.blocks[block_id] = kv

    def fetch(self, block_ids: Sequence[int]) -> Mapping[int, BlockKV]:
        self.calls += 1
        self.requested.append(list(block_ids))
        out = {b: self.blocks[b] for b in block_ids if b in self.blocks}
        self.blocks_served += len(out)
        self.bytes_served += sum(kv.nbytes for kv in out.values())
        return out


@dataclass(frozen=True, slots=True)
class OffloadedDecodeResult:
    """One decode step: the output, what was attended, what had to be fetched, what was missing."""

    output: torch.Tensor
    block_ids: torch.Tensor
    fetched: tuple[int, ...]
    missing: tuple[int, ...]
    retrieved: bool


class OffloadedSequence:
    """A request's KV with at most ``resident_blocks`` full blocks kept locally (LRU) beyond the windows."""

    def __init__(
        self,
        method: BlockSparseMethod,
        fetcher: BlockFetcher,
        *,
        block_size: int,
        resident_blocks: int,
    ) -> None:
        self.method = method
        self.fetcher = fetcher
        self.block_size = block_size
        self.capacity = resident_blocks
        self.state = DecodeState()
        self.resident: OrderedDict[int, BlockKV] = OrderedDict()
        self._tail_k: torch.Tensor | None = None
        self._tail_v: torch.Tensor | None = None
        self.num_tokens = 0

    @classmethod
    def from_prefill(
        cls,
        method: BlockSparseMethod,
        fetcher: BlockFetcher,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        block_size: int,
        resident_blocks: int,
        keep_resident: Iterable[int] = (),
    ) -> OffloadedSequence:
        """A sequence whose prefill KV was dumped to the store; only ``keep_resident`` blocks stay local.

        Representatives are computed here, while the keys are still at hand, as ESA does at prefill.
        """
        seq = cls(method, fetcher, block_size=block_size, resident_blocks=resident_blocks)
        full = method.extend_features(seq.state, keys.shape[0], block_size, lambda a, b: keys[a:b])
        for b in keep_resident:
            if b < full:
                sl = slice(b * block_size, (b + 1) * block_size)
                seq.resident[b] = BlockKV(keys[sl].clone(), values[sl].clone())
        seq._tail_k = keys[full * block_size :].clone()
        seq._tail_v = values[full * block_size :].clone()
        seq.num_tokens = keys.shape[0]
        return seq

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Add one token's ``[num_kv_heads, head_dim]`` key and value; a filled block becomes resident."""
        assert self._tail_k is not None and self._tail_v is not None
        self._tail_k = torch.cat([self._tail_k, key[None]])
        self._tail_v = torch.cat([self._tail_v, value[None]])
        self.num_tokens += 1
        if self._tail_k.shape[0] == self.block_size:
            block = self.num_tokens // self.block_size - 1
            self.resident[block] = BlockKV(self._tail_k, self._tail_v)
            self._tail_k = self._tail_k[:0]
            self._tail_v = self._tail_v[:0]

    def _read_keys(self, start: int, end: int) -> torch.Tensor:
        # Only blocks that filled up after prefill are asked for, and those are resident.
        blocks = range(start // self.block_size, end // self.block_size)
        return torch.cat([self.resident[b].keys for b in blocks])

    def decode(self, query: torch.Tensor, scale: float) -> OffloadedDecodeResult:
        """Select, fetch what is not resident (one batched call), attend exactly to the selection."""
        block_ids, retrieved = self.method.select(
            query, self.num_tokens, self.state, self.block_size, self._read_keys
        )
        full = self.num_tokens // self.block_size
        wanted = [b for b in block_ids.tolist() if b < full]
        need = [b for b in wanted if b not in self.resident]
        got = self.fetcher.fetch(need) if need else {}
        missing = tuple(b for b in need if b not in got)
        for b in wanted:
            if b in got:
                self.resident[b] = got[b]
            if b in self.resident:
                self.resident.move_to_end(b)
        parts = [self.resident[b] for b in wanted if b in self.resident]
        keys = torch.cat([p.keys for p in parts] + [self._tail_k])  # type: ignore[list-item]
        values = torch.cat([p.values for p in parts] + [self._tail_v])  # type: ignore[list-item]
        out = dense_decode_attention(query, keys, values, scale)
        self._evict(protect=set(wanted))
        return OffloadedDecodeResult(out, block_ids, tuple(b for b in need if b in got), missing, retrieved)

    def _evict(self, protect: set[int]) -> None:
        while len(self.resident) > self.capacity:
            victim = next((b for b in self.resident if b not in protect), None)
            if victim is None:
                break
            del self.resident[victim]
