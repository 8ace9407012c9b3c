"""``UcmHiCacheStorage``: SGLang's HiCache L3 storage backend, on ``ucm-server``.

SGLang loads it by module path (``--hicache-storage-backend dynamic`` and an extra config naming
``ucm_client.sglang.backend`` / ``UcmHiCacheStorage``; see docs/sglang.md). Its HiCache controller
then calls, from its prefetch and backup threads:

- ``batch_exists(keys)``: how many leading pages the daemon holds (one ``Lookup``);
- with ``interface_v1``, ``batch_get_v1`` / ``batch_set_v1(keys, host_indices)``: pages straight
  between the daemon's tiers and SGLang's host pool, which is shared with the daemon as memory
  (``host_pool.share_in_place``): one ``Load`` / ``Dump`` per batch, no byte through this process;
- without it, ``batch_get`` / ``batch_set`` with flat page tensors, through shared staging slots.

The daemon being down or slow never stops SGLang: every call answers "missing" / "not stored" for
pages it could not move (SGLang recomputes them), the daemon is then left alone for
``reconnect_interval_s`` (``DaemonLink``, as for vLLM), and a read that takes too long is cancelled
before its pages are reported missing, so the daemon never writes into pages SGLang has reused.
Bad input (keys that are not SGLang page hashes, host indices outside the pool, a layout we cannot
store, a bad setting) is an error naming it: settings and layout at start-up, the rest per call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from ucm_client import BlockIO, BlockState, Segment, UcmClient
from ucm_client.errors import UcmError
from ucm_client.sglang.config import LOGGER_NAME, load_config
from ucm_client.sglang.host_pool import PoolPages, share_in_place
from ucm_client.sglang.identity import page_keys, sglang_namespace
from ucm_client.sglang.staging import Slots
from ucm_client.vllm.link import DaemonLink
from ucm_protocol.errors import InvalidArgument

__all__ = ["UcmHiCacheStorage"]

logger = logging.getLogger(LOGGER_NAME)
T = TypeVar("T")


class UcmHiCacheStorage(HiCacheStorage):
    """One SGLang rank's pages in ``ucm-server``, under this rank's namespace."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        self.config, self.retention = load_config(extra)
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        self.link = DaemonLink(
            self.config.target,
            reconnect_interval_s=self.config.reconnect_interval_s,
            connect_timeout_s=self.config.connect_timeout_s,
            rpc_timeout_s=self.config.rpc_timeout_s,
            on_connect=self._register,
            role="hicache",
            engine="SGLang",
            token=self.config.token,
        )
        self.pages: PoolPages | None = None
        self.namespace = b""
        self.shared: Any = None
        """The host pool's memory as a ``SharedBuffer`` (zero copy), or None (staging)."""
        self.shared_region: int | None = None
        self.not_shared = "the host pool is not registered yet"
        self.reads: Slots | None = None
        self.writes: Slots | None = None
        self._pool_bytes: np.ndarray[Any, Any] | None = None

    # -- start-up ------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Check the pool (a layout we cannot store fails SGLang's start-up, named), derive the
        namespace, share the pool with the daemon where possible, and connect once."""
        super().register_mem_pool_host(mem_pool_host)
        pages = PoolPages(mem_pool_host)
        self.pages = pages
        self.namespace = sglang_namespace(self.storage_config, mem_pool_host, self.config.model_id)
        kv = mem_pool_host.kv_buffer
        self._pool_bytes = kv.view(-1).view(torch.uint8).numpy()
        if self.interface_v1 and self.config.zero_copy:
            shared = share_in_place(pages)
            if isinstance(shared, str):
                self.not_shared = shared
            else:
                self.shared, self.not_shared = shared, ""
        elif not self.interface_v1:
            self.not_shared = "the generic interface (interface_v1 off) hands flat pages, not the pool"
        else:
            self.not_shared = "zero_copy is off"
        buffer_bytes = self.config.staging_buffer_mib << 20
        self.reads = Slots(pages.page_bytes, buffer_bytes, "sglang-staging-reads")
        self.writes = Slots(pages.page_bytes, buffer_bytes, "sglang-staging-writes")
        how = "shared with the daemon in place" if self.shared is not None else f"staged ({self.not_shared})"
        logger.info(
            "UCM: SGLang host pool (%s, %d tokens, %d-byte pages, layout %s) %s; namespace %s",
            type(mem_pool_host).__name__,
            pages.size,
            pages.page_bytes,
            pages.layout,
            how,
            self.namespace.hex(),
        )
        self.link.client()  # connect now: a daemon that is not there is said at start-up, once

    def _register(self, client: UcmClient) -> None:
        """Register the shared memory with a (re)connected client; the client itself registers it
        again after a daemon restart, so these handles stay valid."""
        if self.shared is not None:
            self.shared_region = client.register(self.shared, label="sglang-host-pool")
        for slots in (self.reads, self.writes):
            if slots is not None:
                slots.region = client.register(slots.buffer, label=slots.buffer.label)

    # -- calls to the daemon ---------------------------------------------------------------------------
    def _with_client(self, what: str, fallback: T, call: Callable[[UcmClient], T]) -> T:
        """Run ``call`` with the connected client; the daemon's absence or failure is ``fallback``."""
        client = self.link.client()
        if client is None:
            return fallback
        try:
            result = call(client)
        except UcmError as exc:
            if isinstance(exc, InvalidArgument):
                raise
            if not self.link.failed(exc):
                logger.warning("UCM: %s failed: %s", what, exc)
            return fallback
        self.link.succeeded()
        return result

    def _move(self, client: UcmClient, load: bool, blocks: Sequence[BlockIO]) -> list[bool]:
        """One Load or Dump and its wait; a wait that times out cancels, so no copy outlives it."""
        if load:
            task = client.load(self.namespace, blocks)
            timeout = self.config.load_timeout_s
        else:
            task = client.dump(self.namespace, blocks, wait_durable=self.config.wait_durable)
            timeout = self.config.save_timeout_s
        result = client.wait(task, timeout, cancel_on_timeout=True)
        if not result.done:
            logger.warning(
                "UCM: a %s of %d pages took over %g s; cancelled",
                "read" if load else "write",
                len(blocks),
                timeout,
            )
        return [s is BlockState.OK for s in result.states] if result.done else [False] * len(blocks)

    def _pool_pages(self, keys: list[str], host_indices: Any) -> tuple[list[bytes], np.ndarray[Any, Any]]:
        if self.pages is None:
            raise RuntimeError("UcmHiCacheStorage: no host pool registered (register_mem_pool_host first)")
        return page_keys(keys), self.pages.page_starts(host_indices, len(keys))

    def _zero_copy_blocks(self, keys: list[bytes], starts: np.ndarray[Any, Any]) -> list[BlockIO]:
        assert self.pages is not None and self.shared_region is not None
        offsets, lengths = self.pages.ranges(starts)
        region, sizes = self.shared_region, lengths.tolist()
        return [
            BlockIO(key, tuple(Segment(region, o, n) for o, n in zip(row, sizes, strict=True)))
            for key, row in zip(keys, offsets.tolist(), strict=True)
        ]

    # -- the zero-copy interface (interface_v1) -------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        wanted = page_keys(keys)
        if not wanted:
            return 0

        def lookup(client: UcmClient) -> int:
            hit = client.lookup(self.namespace, wanted).hit_prefix
            if hit and self.config.prefetch_on_lookup:
                client.prefetch_nowait(self.namespace, wanted[:hit])
            return hit

        return self._with_client("lookup", 0, lookup)

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        wanted, starts = self._pool_pages(keys, host_indices)
        if self.shared is None:
            return self._staged(load=True, keys=wanted, starts=starts)

        def load(client: UcmClient) -> list[bool]:
            return self._move(client, True, self._zero_copy_blocks(wanted, starts))

        return self._with_client("read", [False] * len(wanted), load)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        wanted, starts = self._pool_pages(keys, host_indices)
        if self.shared is None:
            stored = self._staged(load=False, keys=wanted, starts=starts)
        else:

            def dump(client: UcmClient) -> list[bool]:
                return self._move(client, False, self._zero_copy_blocks(wanted, starts))

            stored = self._with_client("write", [False] * len(wanted), dump)
        self._retain([k for k, ok in zip(wanted, stored, strict=True) if ok])
        return stored

    def _staged(self, *, load: bool, keys: list[bytes], starts: np.ndarray[Any, Any]) -> list[bool]:
        """Pool pages through the staging slots, as many per round trip as there are slots."""
        assert self.pages is not None and self._pool_bytes is not None
        slots = self.reads if load else self.writes
        assert slots is not None
        offsets, lengths = self.pages.ranges(starts)
        sizes = lengths.tolist()
        done: list[bool] = []
        with slots.lock:
            for first in range(0, len(keys), slots.count):
                part = keys[first : first + slots.count]
                rows = offsets[first : first + len(part)]
                if not load:
                    slots.gather(self._pool_bytes, rows, sizes)
                ok = self._slots_move(slots, load, part)
                if load:  # only the leading pages that arrived count for SGLang: copy those
                    lead = ok.index(False) if False in ok else len(ok)
                    slots.scatter(self._pool_bytes, rows[:lead], sizes)
                    ok = [i < lead for i in range(len(part))]
                done.extend(ok)
                if not all(ok):
                    break
        return done + [False] * (len(keys) - len(done))

    def _slots_move(self, slots: Slots, load: bool, keys: Sequence[bytes]) -> list[bool]:
        blocks = [BlockIO(key, slots.segments(i)) for i, key in enumerate(keys)]
        what = "read" if load else "write"
        return self._with_client(what, [False] * len(keys), lambda c: self._move(c, load, blocks))

    def _retain(self, keys: list[bytes]) -> None:
        """Apply the configured retention to pages just stored (failures are logged, never raised)."""
        r = self.retention
        if r is None or not keys:
            return
        self._with_client(
            "retention",
            None,
            lambda c: c.set_retention(self.namespace, keys, pin=r.pin, ttl_s=r.ttl_s, priority=r.priority),
        )

    # -- the generic interface (flat page tensors) ----------------------------------------------------
    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        wanted = page_keys(keys)
        targets = self._flat_pages(target_locations, len(wanted), "target_locations")
        slots = self.reads
        assert slots is not None
        out: list[torch.Tensor | None] = [None] * len(wanted)
        with slots.lock:
            for first in range(0, len(wanted), slots.count):
                part = wanted[first : first + slots.count]
                ok = self._slots_move(slots, True, part)
                for i, good in enumerate(ok):
                    if good:
                        target = targets[first + i]
                        target.view(-1).view(torch.uint8).copy_(torch.from_numpy(slots.slot(i)))
                        out[first + i] = target
                if not all(ok):
                    break
        return out

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        wanted = page_keys(keys)
        pages = self._flat_pages(values, len(wanted), "values")
        slots = self.writes
        assert slots is not None
        stored: list[bytes] = []
        with slots.lock:
            for first in range(0, len(wanted), slots.count):
                part = wanted[first : first + slots.count]
                for i in range(len(part)):
                    slots.slot(i)[:] = pages[first + i].contiguous().view(-1).view(torch.uint8).numpy()
                ok = self._slots_move(slots, False, part)
                stored.extend(k for k, g in zip(part, ok, strict=True) if g)
                if not all(ok):
                    break
        self._retain(stored)
        return len(stored) == len(wanted)

    def _flat_pages(self, tensors: Any, count: int, name: str) -> list[torch.Tensor]:
        """Flat page tensors of exactly one page's bytes each, one per key; named error otherwise."""
        assert self.pages is not None
        if tensors is None or len(tensors) != count:
            got = "none" if tensors is None else str(len(tensors))
            raise InvalidArgument(f"{name}: {got} page tensors for {count} keys")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                raise InvalidArgument(f"{name}[{i}] is not a CPU tensor")
            size = t.numel() * t.element_size()
            if size != self.pages.page_bytes:
                raise InvalidArgument(f"{name}[{i}] holds {size} bytes; a page is {self.pages.page_bytes}")
        return list(tensors)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the rest -------------------------------------------------------------------------------------
    def clear(self) -> None:
        """SGLang's "clear the storage tier": the daemon's pages are shared with other servers and
        outlive this one, so nothing is deleted here (``ucm-admin evict`` does that, deliberately)."""
        logger.info("UCM: clear() leaves the daemon's pages in place (use ucm-admin to evict them)")

    def get_stats(self) -> None:
        return None

    def close(self) -> None:
        self.link.close()
        for slots in (self.reads, self.writes):
            if slots is not None:
                slots.close()
        self.reads = self.writes = None
        if self.shared is not None:  # our own mapping of it; SGLang's mapping of the pool stays
            self.shared.close()
            self.shared = None
