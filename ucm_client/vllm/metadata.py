"""The only channel from the scheduler half to the worker half: what to load and save this step.

Plain frozen dataclasses of ints and bytes, so vLLM can pickle them to worker processes cheaply.
Keys travel with block ids because only the scheduler sees ``request.block_hashes``; namespaces do
not, since each worker derives its own (its TP rank is part of it), with the transfer's KV cache group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from ucm_client.sparse.vllm.channel import SparseStep

__all__ = ["BlockTransfer", "UcmConnectorMetadata"]


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """One request's blocks to move: ``block_ids[i]`` in vLLM's cache holds the block ``keys[i]``."""

    req_id: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    is_async: bool = False
    group: int = 0
    """The KV cache group the blocks belong to (always 0 unless the model is hybrid)."""

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.keys):
            raise ValueError(f"{self.req_id}: {len(self.block_ids)} block ids for {len(self.keys)} keys")


@dataclass
class UcmConnectorMetadata(KVConnectorMetadata):
    """One step's work for every worker (each applies it to its own shard)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    """Hits to copy from the daemon into vLLM's blocks; sync ones before this step's forward."""

    saves: list[BlockTransfer] = field(default_factory=list)
    """Full blocks this step completes, to dump after the forward without waiting for them."""

    preempted_req_ids: frozenset[str] = frozenset()
    """Requests whose blocks vLLM is about to reuse: their pending saves must finish first."""

    allocated_block_ids: frozenset[int] = frozenset()
    """Hybrid models only: the blocks vLLM handed out this step. vLLM frees a sliding-window block
    as soon as it leaves the window, while the request still runs, so a dump still reading it must
    finish before this step's forward writes into it again."""

    sparse: SparseStep | None = None
    """Sparse attention's orders for this step, when the connector carries its channel
    (``ucm_sparse_config`` set): which request each batch row is, retrievals, cold KV."""
