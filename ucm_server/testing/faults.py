"""Test doubles for storage faults that cannot be caused for real, portably, on a test machine.

Disk-full *can* be caused for real (a small tmpfs), and the hardening tests do that. A medium error
on read (``EIO``) needs device-mapper's ``error`` target or a failing disk, which CI containers do
not have; a disk that is merely *slow* needs a throttled block device. So these two faults come from
wrappers, named for what they are, that sit in a daemon's ``store_pipeline`` like any tier::

    ucm-server --store-pipeline 'Cache|ucm_server.testing.faults:FaultInjectingTier'
    UCM_TIER_SETTINGS='{"ucm_server.testing.faults:FaultInjectingTier": {"root": "/tmp/x",
                        "eio_read_digests": ["<64 hex>"]}}'

Both wrap a real :class:`~ucm_server.store.posix.PosixTier` (so files, headers, checksums and the
index are the real ones) and change only the one thing they inject, following the house rule that
cross-cutting concerns are wrappers around a backend.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from ucm_server.api.errors import ConfigError
from ucm_server.keys import BlockKey, Namespace
from ucm_server.store.base import BlockInfo, BlockResult, IoVec, Tier, TierStats
from ucm_server.store.posix import PosixTier


def _posix_from_settings(name: str, settings: Mapping[str, Any], known: set[str]) -> PosixTier:
    """The wrapped Posix tier, from the same ``root``/``durable``/``capacity`` settings everywhere."""
    unknown = set(settings) - known
    if unknown:
        raise ConfigError(f"tier_settings.{name}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    root = settings.get("root")
    if not isinstance(root, str) or not root:
        raise ConfigError(f"tier_settings.{name}.root: a directory for the wrapped Posix tier is required")
    durable, capacity = settings.get("durable", True), settings.get("capacity", 0)
    if not isinstance(durable, bool):
        raise ConfigError(f"tier_settings.{name}.durable: expected true or false, got {durable!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ConfigError(f"tier_settings.{name}.capacity: expected bytes >= 0, got {capacity!r}")
    return PosixTier(name, roots=[Path(root)], durable=durable, capacity=capacity)


class _PosixWrapper(Tier):
    """Delegates the eight primitives to a real PosixTier; subclasses change one behaviour."""

    persistent: ClassVar[bool] = True
    shared: ClassVar[bool] = False
    max_concurrency: ClassVar[int] = PosixTier.max_concurrency

    def __init__(self, inner: PosixTier) -> None:
        super().__init__(inner.name)
        self.inner = inner

    async def open(self) -> None:
        await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()

    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        return await self.inner.lookup(keys)

    async def lookup_digests(self, namespace: Namespace, digests: Sequence[bytes]) -> list[int | None]:
        return await self.inner.lookup_digests(namespace, digests)

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        return await self.inner.read_into(key, dest)

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        return await self.inner.write_from(key, src)

    async def delete(self, keys: Sequence[BlockKey]) -> int:
        return await self.inner.delete(keys)

    async def list_blocks(self, namespace: Namespace | None = None) -> AsyncIterator[BlockInfo]:
        async for info in self.inner.list_blocks(namespace):
            yield info

    def stats(self) -> TierStats:
        s = self.inner.stats()
        s.kind = self.kind
        return s

    async def info(self, key: BlockKey) -> BlockInfo | None:
        return await self.inner.info(key)

    async def evict(self, nbytes: int) -> int:
        return await self.inner.evict(nbytes)


class FaultInjectingTier(_PosixWrapper):
    """TEST DOUBLE: a real PosixTier whose reads of chosen blocks fail with ``EIO``.

    A medium error cannot be caused portably (device-mapper's ``error`` target is missing in most
    containers), so this raises ``OSError(EIO)`` exactly where a failing disk would: inside the Posix
    tier's blocking read, before any payload byte is copied. The Posix tier's own error handling then
    runs unchanged (its ``errors`` counter, the per-block FAILED result and its reason), which is what
    the tests exercise.

    Settings (``tier_settings``): ``root`` (directory of the wrapped Posix tier), ``durable``,
    ``capacity``, and ``eio_read_digests`` — hex digests (64 characters, any namespace) whose reads
    fail; ``"*"`` in the list fails every read.
    """

    kind: ClassVar[str] = "FaultInjecting"
    _SETTINGS: ClassVar[set[str]] = {"root", "durable", "capacity", "eio_read_digests"}

    def __init__(self, inner: PosixTier, eio_read_digests: Sequence[str] = ()) -> None:
        super().__init__(inner)
        self.fail_all = "*" in eio_read_digests
        self.fail_digests = {bytes.fromhex(d) for d in eio_read_digests if d != "*"}
        self.injected = 0
        real_read: Callable[[Path, BlockKey, IoVec], None] = inner._read_file

        def read_file(path: Path, key: BlockKey, dest: IoVec) -> None:
            if self.fail_all or key.digest in self.fail_digests:
                self.injected += 1
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
            real_read(path, key, dest)

        inner._read_file = read_file  # type: ignore[method-assign]  # the one seam we fault

    @classmethod
    def from_settings(cls, name: str, settings: Mapping[str, Any]) -> FaultInjectingTier:
        digests = settings.get("eio_read_digests", [])
        if not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
            raise ConfigError(f"tier_settings.{name}.eio_read_digests: expected a list of hex strings")
        try:
            for d in digests:
                if d != "*":
                    bytes.fromhex(d)
        except ValueError as exc:
            raise ConfigError(f"tier_settings.{name}.eio_read_digests: not hexadecimal ({exc})") from exc
        return cls(_posix_from_settings(name, settings, cls._SETTINGS), digests)

    def stats(self) -> TierStats:
        s = super().stats()
        s.extra = {**s.extra, "injected_eio": float(self.injected)}
        return s


class LatencyInjectingTier(_PosixWrapper):
    """TEST DOUBLE: a real PosixTier behind a slow device (fixed delay per block read / write).

    A slow disk cannot be made on demand in a test container. The delay is an ``asyncio.sleep``,
    which models what a slow disk does to the daemon: the operation takes long, while the event loop
    (real disk work runs in the thread pool) stays free to answer others. A read sleeps *after* its
    bytes are copied, since a real slow read returns what the file held when it was opened, even if
    a newer version is renamed over it meanwhile; a write sleeps *before*, since a real slow write
    becomes visible only when it ends.

    Settings: ``root``, ``durable``, ``capacity`` as for the Posix tier, and ``read_delay_s`` /
    ``write_delay_s`` (seconds per block, default 0).
    """

    kind: ClassVar[str] = "LatencyInjecting"
    _SETTINGS: ClassVar[set[str]] = {"root", "durable", "capacity", "read_delay_s", "write_delay_s"}

    def __init__(self, inner: PosixTier, *, read_delay_s: float = 0.0, write_delay_s: float = 0.0) -> None:
        super().__init__(inner)
        self.read_delay_s = read_delay_s
        self.write_delay_s = write_delay_s

    @classmethod
    def from_settings(cls, name: str, settings: Mapping[str, Any]) -> LatencyInjectingTier:
        delays: dict[str, float] = {}
        for key in ("read_delay_s", "write_delay_s"):
            value = settings.get(key, 0.0)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 60:
                raise ConfigError(f"tier_settings.{name}.{key}: expected seconds in [0, 60], got {value!r}")
            delays[key] = float(value)
        return cls(_posix_from_settings(name, settings, cls._SETTINGS), **delays)

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        result = await self.inner.read_into(key, dest)
        if self.read_delay_s:
            await asyncio.sleep(self.read_delay_s)
        return result

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        if self.write_delay_s:
            await asyncio.sleep(self.write_delay_s)
        return await self.inner.write_from(key, src)
