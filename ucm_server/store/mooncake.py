"""The Mooncake tier: blocks in a Mooncake Store cluster shared by every node's daemon.

Mooncake Store (``mooncake.store.MooncakeDistributedStore``) keeps objects in memory segments that
its clients contribute, with a master holding the metadata. We store one object per block under
``<key_prefix>/<namespace hex>/<key hex>``; the object is the 128-byte header of
:mod:`ucm_server.store.format` followed by the payload, and every read verifies it, so an object that
was torn, overwritten by something else or stored under the wrong name is reported FAILED, never served.

Bytes move through a few *staging buffers* registered with the transfer engine once at :meth:`open`:
a batch copies its blocks (header + iovec) into one staging buffer and moves them all with one
``batch_upsert_from`` / ``batch_get_into`` call, so the engine transfers straight from and into
registered memory with no per-call registration and no Python ``bytes`` in between. A block larger than
a staging buffer falls back to the engine's plain ``upsert``/``get`` (one extra copy).

Engine behaviours this module exists to contain:

* ``put`` of an existing key silently keeps the old value, so writes use ``upsert``.
* A read takes a lease (10 s by default) and ``remove`` fails while it is held: :meth:`delete` never
  forces removal of a block another node may be reading unless ``force_delete`` is set; such blocks
  are simply not counted as deleted (they stay readable and valid).
* ``get`` of a missing key returns ``b''`` and ``get_into`` a negative code: both become MISSING.
* Calls block in C++ and wait seconds when the master is gone, so each runs on our own threads under
  ``timeout_s``; a timed-out or failed call is a per-block FAILED result counted in ``stats().errors``,
  and the staging buffer it used is only reused once the engine call has really returned. A write
  reported FAILED that way may still land when the master answers again; readers then get that
  version or the previous one, each a whole verified block.

The master forgets everything when it restarts (the client reconnects by itself, so the tier keeps
working without being recreated), and objects living in a client's segment go when that client closes.
``persistent`` therefore means "outlives this daemon while the cluster runs", which is what a shared
tier offers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import dataclasses
import logging
import mmap
import os
import socket
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from ucm_protocol.errors import ConfigError, Unavailable
from ucm_protocol.keys import KEY_BYTES, NAMESPACE_BYTES, BlockKey, Digest, Namespace
from ucm_server.store.base import (
    MISSING,
    OK,
    BlockInfo,
    BlockResult,
    IoVec,
    Tier,
    TierStats,
    copy_iov,
    failed,
    iov_len,
)
from ucm_server.store.format import (
    HEADER_SIZE,
    CorruptBlock,
    decode_header,
    encode_header,
    payload_checksum,
    verify_payload,
)
from ucm_server.store.io_classes import ClassedExecutor

log = logging.getLogger(__name__)
T = TypeVar("T")

# Mooncake error codes we meet (mooncake-store/include/types.h); others are reported by number.
OBJECT_NOT_FOUND = -704
BUFFER_OVERFLOW = -600
_ERROR_NAMES = {
    -200: "NO_AVAILABLE_HANDLE (store full)",
    -600: "BUFFER_OVERFLOW (stored object is larger than expected)",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE (being read)",
    -900: "RPC_FAIL (master unreachable)",
}


def _code_name(code: int) -> str:
    return _ERROR_NAMES.get(code, f"error {code}")


@dataclass(slots=True)
class _Staging:
    """One registered buffer; ``addr`` is what the engine is given, ``view`` what Python copies through."""

    mem: mmap.mmap
    view: memoryview
    addr: int


@dataclass(frozen=True, slots=True)
class MooncakeSettings:
    """The Mooncake tier's ``tier_settings`` entry: one field per key, with the constructor's defaults."""

    master_address: str = "127.0.0.1:50051"
    """``host:port`` of ``mooncake_master``'s RPC service."""
    metadata_server: str = "P2PHANDSHAKE"
    """transfer-engine metadata: ``"P2PHANDSHAKE"`` (none needed), an ``http://`` metadata server or
    an etcd address."""
    local_hostname: str = "127.0.0.1"
    """the address other nodes reach this node's segment at. On loopback we also export
    ``MC_TCP_BIND_ADDRESS`` with it (unless already set) so the engine binds there."""
    protocol: str = "tcp"
    """transfer protocol, ``"tcp"`` or ``"rdma"``; ``device_name`` names RDMA NICs."""
    device_name: str = ""
    """the RDMA NICs to use with ``protocol: rdma``."""
    global_segment_size: int = 1 << 30
    """bytes this node contributes to the cluster's shared memory pool."""
    local_buffer_size: int = 256 << 20
    """the engine's own transfer buffer for non-registered calls."""
    key_prefix: str = "ucm"
    """object names are ``<key_prefix>/<namespace hex>/<key hex>``; daemons sharing blocks must
    agree on it, unrelated deployments on one cluster must not."""
    timeout_s: float = 5.0
    """limit on every engine call; past it the blocks are FAILED, not waited for. One call moves up
    to ``staging_bytes``, so keep it well above staging_bytes / bandwidth."""
    staging_bytes: int = 64 << 20
    """size of each registered staging buffer; batches are cut to fit it."""
    staging_buffers: int = 2
    """how many batches may be in flight at once."""
    master_http: str = ""
    """the master's HTTP admin URL (``--metrics_port``), used only by :meth:`list_blocks`; default
    ``http://<master host>:9003``."""
    force_delete: bool = False
    """let :meth:`delete` break other readers' leases (off: a block being read elsewhere is left in
    place)."""


class MooncakeTier(Tier):
    """A tier in a Mooncake Store cluster (see the module docstring for the engine's quirks)."""

    kind: ClassVar[str] = "Mooncake"
    persistent: ClassVar[bool] = True
    shared: ClassVar[bool] = True
    pin_gap: ClassVar[str] = "Mooncake evicts by its own policy, which does not read this daemon's pins"

    def __init__(
        self,
        name: str = "Mooncake",
        *,
        master_address: str = "127.0.0.1:50051",
        metadata_server: str = "P2PHANDSHAKE",
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        global_segment_size: int = 1 << 30,
        local_buffer_size: int = 256 << 20,
        key_prefix: str = "ucm",
        timeout_s: float = 5.0,
        staging_bytes: int = 64 << 20,
        staging_buffers: int = 2,
        master_http: str = "",
        force_delete: bool = False,
    ) -> None:
        """Every parameter is a key of the tier's settings, documented on :class:`MooncakeSettings`."""
        super().__init__(name)
        if staging_buffers < 1 or staging_bytes <= HEADER_SIZE or timeout_s <= 0:
            raise ConfigError(
                f"tier {name!r}: staging_buffers must be >= 1, staging_bytes > {HEADER_SIZE}, timeout_s > 0"
            )
        self.master_address = master_address
        self.metadata_server = metadata_server
        self.local_hostname = local_hostname
        self.protocol = protocol
        self.device_name = device_name
        self.global_segment_size = global_segment_size
        self.local_buffer_size = local_buffer_size
        self.key_prefix = key_prefix.strip("/")
        self.timeout_s = timeout_s
        self.staging_bytes = staging_bytes
        self.staging_buffers = staging_buffers
        self.master_http = master_http or f"http://{master_address.rsplit(':', 1)[0]}:9003"
        self.force_delete = force_delete
        self._store: Any = None
        self._pool: ClassedExecutor | None = None
        self._free: asyncio.Queue[_Staging] | None = None
        self._staging: list[_Staging] = []
        self._inflight: set[Future[Any]] = set()
        self._stats = TierStats(name=name, kind=self.kind)
        self._known: dict[BlockKey, int] = {}
        """Blocks this daemon wrote, read or found, and their sizes: the cluster's totals are not
        queryable cheaply, so ``stats().blocks``/``bytes`` report this local view."""

    # -- configuration -----------------------------------------------------------------------------------
    Settings: ClassVar[type[Any] | None] = MooncakeSettings
    """Built by :meth:`Tier.from_settings`: unknown keys and wrong types name the key."""

    # -- life cycle ---------------------------------------------------------------------------------------
    async def open(self) -> None:
        """Connect to the master, contribute our segment and register the staging buffers."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise Unavailable(
                f"tier {self.name!r}: Mooncake is not installed ({exc}); "
                "pip install mooncake-transfer-engine-non-cuda"
            ) from exc
        if self.protocol == "tcp":
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.local_hostname)
        # Loads first, then prefetch, then writes (ucm_server.store.io_classes).
        self._pool = ClassedExecutor(self.staging_buffers + 2, thread_name_prefix=f"ucm-{self.name}")
        where = f"tier {self.name!r}: Mooncake master {self.master_address}"
        try:
            # The engine's setup retries an absent master for ~90 s without letting go of the GIL;
            # a plain connect answers in milliseconds.
            await self._call(lambda: _probe(self.master_address, self.timeout_s))
        except (OSError, TimeoutError, ValueError) as exc:
            self._pool.shutdown(wait=False)
            raise Unavailable(f"{where} is not reachable: {exc}") from exc
        store = MooncakeDistributedStore()
        try:
            rc = await self._call(
                lambda: store.setup(
                    self.local_hostname,
                    self.metadata_server,
                    self.global_segment_size,
                    self.local_buffer_size,
                    self.protocol,
                    self.device_name,
                    self.master_address,
                ),
                limit_s=max(self.timeout_s, 10.0),
            )
        except TimeoutError as exc:
            self._pool.shutdown(wait=False)
            raise Unavailable(f"{where}: setup timed out") from exc
        if rc != 0:
            self._pool.shutdown(wait=False)
            raise Unavailable(f"{where}: setup failed ({_code_name(int(rc))})")
        self._store = store
        self._free = asyncio.Queue()
        for _ in range(self.staging_buffers):
            mem = mmap.mmap(-1, self.staging_bytes)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
            rc = store.register_buffer(addr, self.staging_bytes)
            if rc != 0:
                raise Unavailable(f"{where}: register_buffer failed ({_code_name(int(rc))})")
            staging = _Staging(mem, memoryview(mem), addr)
            self._staging.append(staging)
            self._free.put_nowait(staging)
        log.info(
            "%s: Mooncake master %s, %d staging buffers of %d MiB registered",
            self.name,
            self.master_address,
            self.staging_buffers,
            self.staging_bytes >> 20,
        )

    async def close(self) -> None:
        """Wait (bounded) for engine calls we stopped waiting for, then release everything. Closing
        the engine or its registered buffers under a running call crashes the process, so if calls are
        still stalled after the grace period the client is left open (leaked) instead."""
        store, self._store = self._store, None
        grace = max(self.timeout_s, 10.0)
        pending = [f for f in self._inflight if not f.done()]
        if pending:
            _, stalled = await asyncio.to_thread(concurrent.futures.wait, pending, grace)
            if stalled:
                log.warning(
                    "%s: %d Mooncake calls still stalled after %.0fs; leaving the engine client open",
                    self.name,
                    len(stalled),
                    grace,
                )
                return
        if store is not None:
            for s in self._staging:
                store.unregister_buffer(s.addr)
            try:
                await self._call(store.close, limit_s=grace)
            except TimeoutError:
                log.warning("%s: Mooncake close timed out", self.name)
        for s in self._staging:
            s.view.release()
        self._staging.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # -- primitives -------------------------------------------------------------------------------------
    def object_name(self, key: BlockKey) -> str:
        """The Mooncake key a block is stored under (other daemons compute the same)."""
        return f"{self.key_prefix}/{key.namespace.hex()}/{key.digest.hex()}"

    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """One ``batch_is_exist`` and one replica query for the present keys; errors count as misses."""
        if not keys:
            return []
        store = self._require()
        names = [self.object_name(k) for k in keys]
        try:
            exist: list[int] = await self._call(lambda: store.batch_is_exist(names))
            present = [n for n, e in zip(names, exist, strict=True) if e == 1]
            sizes = await self._call(lambda: _replica_sizes(store, present)) if present else {}
        except TimeoutError:
            self._stats.errors += 1
            self._stats.misses += len(keys)
            log.warning("%s: lookup timed out after %.1fs", self.name, self.timeout_s)
            return [None] * len(keys)
        if any(e < 0 for e in exist):
            self._stats.errors += 1
        out: list[int | None] = []
        for key, n, e in zip(keys, names, exist, strict=True):
            size = sizes.get(n)
            out.append(size - HEADER_SIZE if size is not None and size >= HEADER_SIZE else None)
            if out[-1] is not None:
                self._known[key] = out[-1]
            elif e == 0:
                self._known.pop(key, None)
        hits = sum(1 for s in out if s is not None)
        self._stats.hits += hits
        self._stats.misses += len(out) - hits
        return out

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        return (await self.read_many([(key, dest)]))[0]

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        return (await self.write_many([(key, src)]))[0]

    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Batched through registered staging: one ``batch_get_into`` per staging buffer's worth."""
        return await self._batched(items, self._read_chunk, self._read_big)

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Batched through registered staging: one ``batch_upsert_from`` per staging buffer's worth."""
        return await self._batched(items, self._write_chunk, self._write_big)

    async def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove blocks; a block under another reader's lease stays (unless ``force_delete``)."""
        if not keys:
            return 0
        store = self._require()
        names = [self.object_name(k) for k in keys]
        try:
            codes: list[int] = await self._call(lambda: store.batch_remove(names, self.force_delete))
        except TimeoutError:
            self._stats.errors += 1
            return 0
        leased = sum(1 for c in codes if c == -706)
        if leased:
            self._stats.extra["delete_leased"] = self._stats.extra.get("delete_leased", 0.0) + leased
            log.debug("%s: %d blocks are being read elsewhere; left in place", self.name, leased)
        if any(c < 0 and c not in (-704, -706) for c in codes):
            self._stats.errors += 1
        for key, c in zip(keys, codes, strict=True):
            if c in (0, OBJECT_NOT_FOUND):
                self._known.pop(key, None)
        return sum(1 for c in codes if c == 0)

    async def list_blocks(self, namespace: Namespace | None = None) -> AsyncIterator[BlockInfo]:
        """Every block under our prefix, from the master's HTTP ``/get_all_keys`` (the client API has
        no listing). An unreachable admin endpoint lists nothing and counts an error."""
        prefix = f"{self.key_prefix}/" + (f"{namespace.hex()}/" if namespace is not None else "")
        url = f"{self.master_http.rstrip('/')}/get_all_keys"

        def fetch() -> list[str]:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                return [ln for ln in resp.read().decode().splitlines() if ln.startswith(prefix)]

        try:
            names = await self._call(fetch)
        except (OSError, TimeoutError) as exc:
            self._stats.errors += 1
            log.warning("%s: cannot list blocks via %s: %s", self.name, url, exc)
            return
        keys = [k for k in (self._parse_name(n) for n in names) if k is not None]
        for start in range(0, len(keys), 1024):
            batch = keys[start : start + 1024]
            for key, size in zip(batch, await self.lookup(batch), strict=True):
                if size is not None:
                    yield BlockInfo(key=key, size=size, tier=self.name)

    def stats(self) -> TierStats:
        known = self._known
        return dataclasses.replace(
            self._stats, blocks=len(known), bytes=sum(known.values()), extra=dict(self._stats.extra)
        )

    # -- batching -----------------------------------------------------------------------------------------
    async def _batched(
        self,
        items: Sequence[tuple[BlockKey, IoVec]],
        chunk_fn: Callable[[_Staging, list[tuple[int, BlockKey, IoVec]]], list[BlockResult]],
        big_fn: Callable[[BlockKey, IoVec], BlockResult],
    ) -> list[BlockResult]:
        """Cut ``items`` into staging-sized chunks and run them, each on one staging buffer."""
        self._require()
        results: list[BlockResult] = [failed("not attempted")] * len(items)
        chunks: list[list[tuple[int, BlockKey, IoVec]]] = []
        current: list[tuple[int, BlockKey, IoVec]] = []
        used = 0
        bigs: list[int] = []
        for i, (key, iov) in enumerate(items):
            need = HEADER_SIZE + iov_len(iov)
            if need > self.staging_bytes:
                bigs.append(i)
                continue
            if used + need > self.staging_bytes:
                chunks.append(current)
                current, used = [], 0
            current.append((i, key, iov))
            used += need
        if current:
            chunks.append(current)

        async def run_chunk(chunk: list[tuple[int, BlockKey, IoVec]]) -> None:
            out = await self._with_staging(lambda st: chunk_fn(st, chunk), len(chunk))
            for (i, _, _), r in zip(chunk, out, strict=True):
                results[i] = r

        async def run_big(i: int) -> None:
            key, iov = items[i]
            try:
                results[i] = await self._call(lambda: big_fn(key, iov))
            except TimeoutError:
                self._stats.errors += 1
                results[i] = failed(f"Mooncake call timed out after {self.timeout_s:g}s")

        await asyncio.gather(*(run_chunk(c) for c in chunks), *(run_big(i) for i in bigs))
        return results

    async def _with_staging(self, fn: Callable[[_Staging], list[BlockResult]], n: int) -> list[BlockResult]:
        """Run ``fn`` on a free staging buffer; the buffer returns to the pool only when the engine
        call has finished, even if we stopped waiting for it (a late write into a reused buffer would
        corrupt another batch)."""
        assert self._free is not None and self._pool is not None
        loop = asyncio.get_running_loop()
        try:
            staging = await asyncio.wait_for(self._free.get(), self.timeout_s)
        except TimeoutError:
            self._stats.errors += 1
            return [failed("Mooncake tier busy: every staging buffer is held by a stalled call")] * n
        free = self._free
        fut: Future[list[BlockResult]] = self._pool.submit(fn, staging)
        self._track(fut)
        fut.add_done_callback(lambda _f: loop.call_soon_threadsafe(free.put_nowait, staging))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s)
        except TimeoutError:
            self._stats.errors += 1
            return [failed(f"Mooncake call timed out after {self.timeout_s:g}s")] * n

    # -- work done on engine threads --------------------------------------------------------------------
    def _write_chunk(self, st: _Staging, chunk: list[tuple[int, BlockKey, IoVec]]) -> list[BlockResult]:
        names, ptrs, sizes = [], [], []
        off = 0
        for _, key, iov in chunk:
            n = iov_len(iov)
            st.view[off : off + HEADER_SIZE] = encode_header(key, n, payload_checksum(iov))
            copy_iov([st.view[off + HEADER_SIZE : off + HEADER_SIZE + n]], iov)
            names.append(self.object_name(key))
            ptrs.append(st.addr + off)
            sizes.append(HEADER_SIZE + n)
            off += HEADER_SIZE + n
        codes: list[int] = self._store.batch_upsert_from(names, ptrs, sizes)
        return [
            self._write_result(k, c, s - HEADER_SIZE)
            for (_, k, _), c, s in zip(chunk, codes, sizes, strict=True)
        ]

    def _write_big(self, key: BlockKey, iov: IoVec) -> BlockResult:
        n = iov_len(iov)
        obj = bytearray(HEADER_SIZE + n)
        obj[:HEADER_SIZE] = encode_header(key, n, payload_checksum(iov))
        copy_iov([memoryview(obj)[HEADER_SIZE:]], iov)
        return self._write_result(key, int(self._store.upsert(self.object_name(key), obj)), n)

    def _write_result(self, key: BlockKey, code: int, n: int) -> BlockResult:
        if code == 0:
            self._stats.write_bytes += n
            self._known[key] = n
            return OK
        self._stats.errors += 1
        return failed(f"Mooncake upsert: {_code_name(code)}")

    def _read_chunk(self, st: _Staging, chunk: list[tuple[int, BlockKey, IoVec]]) -> list[BlockResult]:
        names, ptrs, sizes = [], [], []
        off = 0
        for _, key, iov in chunk:
            names.append(self.object_name(key))
            ptrs.append(st.addr + off)
            sizes.append(HEADER_SIZE + iov_len(iov))
            off += sizes[-1]
        codes: list[int] = self._store.batch_get_into(names, ptrs, sizes)
        out = []
        off = 0
        for (_, key, iov), code, size in zip(chunk, codes, sizes, strict=True):
            out.append(self._check_and_copy(key, iov, code, st.view[off : off + max(code, 0)]))
            off += size
        return out

    def _read_big(self, key: BlockKey, iov: IoVec) -> BlockResult:
        raw: bytes = self._store.get(self.object_name(key))
        return self._check_and_copy(key, iov, len(raw) if raw else OBJECT_NOT_FOUND, memoryview(raw))

    def _check_and_copy(self, key: BlockKey, dest: IoVec, code: int, obj: memoryview) -> BlockResult:
        """Verify a fetched object (``code`` = bytes fetched or a Mooncake error) and copy it out."""
        if code in (OBJECT_NOT_FOUND, 0):
            self._known.pop(key, None)
            self._stats.misses += 1
            return MISSING
        if code == BUFFER_OVERFLOW:
            self._stats.errors += 1
            return failed(f"length mismatch: stored block is larger than the reader's {iov_len(dest)} bytes")
        if code < 0:
            self._stats.errors += 1
            return failed(f"Mooncake get: {_code_name(code)}")
        try:
            header = decode_header(obj[:HEADER_SIZE], expect=key)
            payload = obj[HEADER_SIZE:]
            verify_payload(header, [payload])
        except CorruptBlock as exc:
            self._stats.corrupt += 1
            self._stats.errors += 1
            return failed(f"corrupt object {self.object_name(key)}: {exc}")
        if header.payload_len != iov_len(dest):
            self._stats.errors += 1
            return failed(f"length mismatch: block is {header.payload_len} bytes, reader has {iov_len(dest)}")
        copy_iov(dest, [payload])
        self._known[key] = header.payload_len
        self._stats.hits += 1
        self._stats.read_bytes += header.payload_len
        return OK

    # -- helpers ----------------------------------------------------------------------------------------
    def _require(self) -> Any:
        if self._store is None:
            raise Unavailable(f"tier {self.name!r} is not open")
        return self._store

    async def _call(self, fn: Callable[[], T], limit_s: float | None = None) -> T:
        """Run a blocking engine call on our threads, giving up (not the thread) after the timeout."""
        assert self._pool is not None
        fut = self._pool.submit(fn)
        self._track(fut)
        return await asyncio.wait_for(asyncio.wrap_future(fut), limit_s or self.timeout_s)

    def _track(self, fut: Future[Any]) -> None:
        """Remember a running engine call until it ends (``close`` must not pull the engine from under it)."""
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)

    def _parse_name(self, name: str) -> BlockKey | None:
        _, _, rest = name.partition(f"{self.key_prefix}/")
        ns_hex, _, key_hex = rest.partition("/")
        try:
            ns, digest = bytes.fromhex(ns_hex), bytes.fromhex(key_hex)
        except ValueError:
            return None
        if len(ns) != NAMESPACE_BYTES or len(digest) != KEY_BYTES:
            return None
        return BlockKey(Namespace(ns), Digest(digest))


def _probe(address: str, timeout_s: float) -> None:
    """Open and close one TCP connection to ``host:port`` (raises ``OSError`` if nothing listens)."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
        pass


def _replica_sizes(store: Any, names: list[str]) -> dict[str, int]:
    """Object sizes from one replica query; objects without a complete memory replica are left out."""
    sizes: dict[str, int] = {}
    for name, replicas in store.batch_get_replica_desc(names).items():
        for r in replicas:
            if r.is_memory_replica():
                sizes[name] = int(r.get_memory_descriptor().buffer_descriptor.size)
                break
    return sizes
