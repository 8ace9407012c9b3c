"""How the daemon reaches this rank's KV cache: one small protocol, three ways, chosen once.

The worker schedules transfers; what a block *is* in daemon terms (which registered region, which
byte ranges, whether bytes must be copied through a bounce buffer first) depends on where vLLM keeps
its KV cache. That choice is made once per registration by :func:`choose_kv_access` and hidden behind
:class:`KVAccess`:

- :class:`CudaIpcKV`: CUDA KV cache, every storage registered by CUDA IPC; the daemon copies with
  ``cudaMemcpyAsync`` straight into vLLM's pages (zero copy). Dumps must wait for the kernels that
  wrote the pages (``before_dump``, ``mark``).
- :class:`SharedMemoryKV`: CPU KV cache placed in shared memory (``kv_memory``); the daemon copies
  straight into vLLM's pages (zero copy).
- :class:`StagedKV`: anything else (``zero_copy: false``, or CUDA IPC refused): whole blocks go
  through the slots of a shared-memory staging buffer (``staging``); saves copy out of the KV cache
  before they are submitted, loads copy into it once they ended.

The two zero-copy ways can also move one layer's page of a block (:class:`LayerKVAccess`, needed by
``use_layerwise``); staging cannot, and the chooser then says why no bytes move at all.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from ucm_client import BlockIO, UcmClient
from ucm_client.cuda_ipc import StreamMark, producers_done
from ucm_client.load_progress import ProgressWords
from ucm_client.vllm.config import LOGGER_NAME
from ucm_client.vllm.cuda_kv import CudaKVCache
from ucm_client.vllm.kv_memory import KVMemory, ShmAllocation, adopt
from ucm_client.vllm.staging import StagingArea

__all__ = [
    "CudaIpcKV",
    "KVAccess",
    "LayerKVAccess",
    "SharedMemoryKV",
    "StagedKV",
    "choose_kv_access",
    "staged_kv_access",
]

logger = logging.getLogger(LOGGER_NAME)


@runtime_checkable
class KVAccess(Protocol):
    """What the worker needs to move whole blocks between the daemon and the KV cache."""

    label: str
    """Label of the daemon region(s) (``vllm-kv-cache`` or ``vllm-kv-staging``)."""

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block (every layer's page, in address order)."""
        ...

    def register(self, client: UcmClient) -> None:
        """Register the memory the daemon copies to and from (CUDA: may raise ``CudaUnavailable``)."""
        ...

    def regions(self) -> list[int]:
        """The daemon regions registered so far (for the worker to unregister)."""
        ...

    def acquire(self, block_ids: Sequence[int], *, save: bool) -> list[int] | None:
        """Make a whole-block part of ``block_ids`` ready to submit; the staging slots it holds.

        Zero copy: ``[]`` (the blocks are vLLM's own pages). Staging: one slot per block, filled
        from the KV cache first when saving; None when the staging buffer has no room (skipped).
        """
        ...

    def blocks(self, keys: Sequence[bytes], block_ids: Sequence[int], slots: Sequence[int]) -> list[BlockIO]:
        """Where each whole block's bytes go: vLLM's own pages (zero copy) or the staging ``slots``."""
        ...

    def finish(self, slots: Sequence[int], ids: Sequence[int], ok: Sequence[bool], *, load: bool) -> None:
        """A whole-block part of blocks ``ids`` ended (``ok`` per block): staging copies the good
        loads into the KV cache and frees the slots; zero copy has nothing to do."""
        ...

    def before_dump(self) -> None:
        """Before a dump of pages the forward just wrote is submitted: let those kernels finish (CUDA)."""
        ...

    def mark(self) -> StreamMark | None:
        """A mark recorded after the kernels queued so far (CUDA), to dump a layer once it is reached."""
        ...


@runtime_checkable
class LayerKVAccess(KVAccess, Protocol):
    """Zero-copy access that can also move one layer's page of a block (``use_layerwise``)."""

    def layer_bytes(self, layer_name: str) -> int:
        """Bytes of layer ``layer_name``'s page of one block."""
        ...

    def layer_blocks(self, layer_name: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> list[BlockIO]:
        """Layer ``layer_name``'s page of each block, stored under ``keys`` (the ``layer_key``s)."""
        ...


class CudaIpcKV:
    """vLLM's CUDA KV cache, each storage registered by CUDA IPC (zero copy)."""

    label = "vllm-kv-cache"

    def __init__(self, cache: CudaKVCache) -> None:
        self.cache = cache

    @property
    def block_bytes(self) -> int:
        return self.cache.block_bytes

    def register(self, client: UcmClient) -> None:
        self.cache.register(client, label=self.label)

    def regions(self) -> list[int]:
        return list(self.cache.regions.values())

    def acquire(self, block_ids: Sequence[int], *, save: bool) -> list[int] | None:
        return []

    def blocks(self, keys: Sequence[bytes], block_ids: Sequence[int], slots: Sequence[int]) -> list[BlockIO]:
        return self.cache.blocks(keys, block_ids)

    def finish(self, slots: Sequence[int], ids: Sequence[int], ok: Sequence[bool], *, load: bool) -> None:
        return None

    def before_dump(self) -> None:
        producers_done()  # the daemon reads the blocks the forward's kernels just wrote

    def mark(self) -> StreamMark | None:
        return StreamMark()

    def layer_bytes(self, layer_name: str) -> int:
        return self.cache.pages_by_name[layer_name].length

    def layer_blocks(self, layer_name: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> list[BlockIO]:
        return self.cache.layer_blocks(layer_name, keys, block_ids)


class SharedMemoryKV:
    """vLLM's CPU KV cache inside one registered shared buffer (zero copy)."""

    label = "vllm-kv-cache"

    def __init__(self, memory: KVMemory) -> None:
        self.memory = memory
        self.region: int | None = None
        self.progress: ProgressWords | None = None
        """Words the daemon counts a whole-block load's copied segments in, so that each attention
        layer waits only for its own page of the blocks (``UcmWorker.wait_for_layer_load``)."""

    @property
    def block_bytes(self) -> int:
        return self.memory.block_bytes

    def register(self, client: UcmClient) -> None:
        self.region = client.register(self.memory.buffer, label=self.label)
        words = ProgressWords()
        words.region = client.register(words.buffer, label=words.buffer.label)
        self.progress = words

    def regions(self) -> list[int]:
        words = self.progress.region if self.progress is not None else None
        return [r for r in (self.region, words) if r is not None]

    def acquire(self, block_ids: Sequence[int], *, save: bool) -> list[int] | None:
        return []

    def blocks(self, keys: Sequence[bytes], block_ids: Sequence[int], slots: Sequence[int]) -> list[BlockIO]:
        assert self.region is not None
        return [
            BlockIO(key=key, segments=self.memory.segments(self.region, block_id))
            for key, block_id in zip(keys, block_ids, strict=True)
        ]

    def finish(self, slots: Sequence[int], ids: Sequence[int], ok: Sequence[bool], *, load: bool) -> None:
        return None

    def before_dump(self) -> None:
        return None  # host memory: the forward's writes are done when the step returns

    def mark(self) -> StreamMark | None:
        return None

    def layer_bytes(self, layer_name: str) -> int:
        return self.memory.pages_by_name[layer_name].length

    def layer_blocks(self, layer_name: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> list[BlockIO]:
        assert self.region is not None
        return [
            BlockIO(key=key, segments=self.memory.layer_segments(self.region, layer_name, block_id))
            for key, block_id in zip(keys, block_ids, strict=True)
        ]


class StagedKV:
    """Whole blocks through the slots of a shared-memory staging buffer (one copy each way)."""

    label = "vllm-kv-staging"

    def __init__(self, staging: StagingArea) -> None:
        self.staging = staging
        self.region: int | None = None

    @property
    def block_bytes(self) -> int:
        return self.staging.block_bytes

    def register(self, client: UcmClient) -> None:
        self.region = client.register(self.staging.buffer, label=self.label)

    def regions(self) -> list[int]:
        return [self.region] if self.region is not None else []

    def acquire(self, block_ids: Sequence[int], *, save: bool) -> list[int] | None:
        slots = self.staging.acquire(len(block_ids))
        if slots is not None and save:  # the daemon reads finished bytes; vLLM may reuse its blocks at once
            self.staging.from_kv(slots, block_ids)
        return slots

    def blocks(self, keys: Sequence[bytes], block_ids: Sequence[int], slots: Sequence[int]) -> list[BlockIO]:
        assert self.region is not None
        return [
            BlockIO(key=key, segments=self.staging.segments(self.region, slot))
            for key, slot in zip(keys, slots, strict=True)
        ]

    def finish(self, slots: Sequence[int], ids: Sequence[int], ok: Sequence[bool], *, load: bool) -> None:
        if load:
            loaded = [(slot, b) for slot, b, g in zip(slots, ids, ok, strict=True) if g]
            if loaded:
                self.staging.to_kv([slot for slot, _ in loaded], [b for _, b in loaded])
        self.staging.release(slots)

    def before_dump(self) -> None:
        return None  # ``acquire`` already copied (and synchronized) the saved blocks

    def mark(self) -> StreamMark | None:
        return None


def staged_kv_access(
    kv_caches: Mapping[str, torch.Tensor], device: str, staging_bytes: int, *, layerwise: bool
) -> StagedKV | str:
    """The staging way for a ``device`` KV cache, or why no bytes can move (layerwise needs zero copy)."""
    if layerwise:
        reason = (
            f"use_layerwise needs the daemon to reach the {device} KV cache directly (zero copy), "
            "the staging buffer moves whole blocks only; loads and saves are off, prefixes are recomputed"
        )
        logger.error("UCM worker: %s", reason)
        return reason
    staging = StagingArea(kv_caches, staging_bytes)
    logger.info(
        "UCM worker: %s KV cache staged through %d shared-memory slots of %d bytes (%s)",
        device,
        staging.num_slots,
        staging.block_bytes,
        staging.buffer.name,
    )
    return StagedKV(staging)


def choose_kv_access(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    zero_copy: bool,
    staging_bytes: int,
    layerwise: bool,
    alloc: ShmAllocation | None,
    vllm_config: Any,
) -> KVAccess | str:
    """Pick how the daemon reaches ``kv_caches``; a string says why no bytes move at all.

    CUDA with ``zero_copy``: CUDA IPC. CPU with ``zero_copy``: the KV cache in shared memory (the
    buffer ``alloc`` answered vLLM's allocation with, else the cache is moved into a new one).
    Anything else: staging. If CUDA IPC is refused at registration the worker falls back to
    :func:`staged_kv_access` (the one re-choice).
    """
    first = next(iter(kv_caches.values()))
    if first.device.type == "cuda" and zero_copy:
        cache = CudaKVCache(kv_caches)
        logger.info(
            "UCM worker: CUDA KV cache (%d blocks x %d bytes) shared with the daemon by CUDA IPC",
            cache.num_blocks,
            cache.block_bytes,
        )
        return CudaIpcKV(cache)
    if first.device.type != "cpu" or not zero_copy:
        return staged_kv_access(kv_caches, first.device.type, staging_bytes, layerwise=layerwise)
    if (
        alloc is not None
        and alloc.tensor is not None
        and alloc.buffer is not None
        and (first.untyped_storage().data_ptr() == alloc.tensor.data_ptr())
    ):
        buffer, raw = alloc.buffer, alloc.tensor
        how = "allocated in shared memory"
    else:
        layers = vllm_config.compilation_config.static_forward_context.values()
        buffer, raw = adopt(kv_caches, layers)
        how = "moved into shared memory"
    memory = KVMemory(buffer, raw, kv_caches)
    logger.info(
        "UCM worker: KV cache (%d blocks x %d bytes) %s (%s); the daemon copies into it directly",
        memory.num_blocks,
        memory.block_bytes,
        how,
        buffer.name,
    )
    return SharedMemoryKV(memory)
