"""Test doubles for storage faults that cannot be caused for real, portably, on a test machine.

Disk-full *can* be caused for real (a small tmpfs), and the hardening tests do that. A medium error
on read (``EIO``) needs device-mapper's ``error`` target or a failing disk, which CI containers do
not have; a disk that is merely *slow* needs a throttled block device. So these two faults come from
wrappers, named for what they are, that sit in a daemon's ``store_pipeline`` like any tier::

    ucm-server --store-pipeline 'Cache|ucm_server.testing.faults:FaultInjectingTier'
    UCM_TIER_SETTINGS='{"ucm_server.testing.faults:FaultInjectingTier": {"root": "/tmp/x",
                        "eio_read_digests": ["<64 hex>"]}}'

Both wrap a real tier (so files, headers, checksums and the index are the real ones) and change only
the one thing they inject, following the house rule that cross-cutting concerns are wrappers around a
backend. By default the wrapped tier is a Posix tier described by ``root``, ``durable`` and
``capacity``; ``inner`` (a ``store_pipeline`` tier name) and ``inner_settings`` (its settings) wrap
any other tier instead::

    UCM_TIER_SETTINGS='{"ucm_server.testing.faults:LatencyInjectingTier": {"inner": "DS3FS",
                        "inner_settings": {"mount": "/3fs/stage"}, "read_delay_s": 0.05}}'
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

from ucm_protocol.errors import ConfigError
from ucm_protocol.keys import BlockKey
from ucm_protocol.settings import load_fields
from ucm_server.store.base import (
    DEFAULT_CONTEXT,
    BlockResult,
    IoVec,
    Tier,
    TierContext,
    TierStats,
    failed,
    iov_len,
)
from ucm_server.store.posix import PosixTier
from ucm_server.store.registry import build_tier
from ucm_server.store.wrapper import TierWrapper


@dataclass(frozen=True, slots=True)
class WrapperSettings:
    """What every wrapper is told about the tier it wraps."""

    root: str = ""
    """Directory of the wrapped Posix tier (the default inner tier); required without ``inner``."""
    durable: bool = True
    """The wrapped Posix tier's ``durable``."""
    capacity: int = field(default=0, metadata={"size": True})
    """The wrapped Posix tier's capacity in bytes (0: no limit)."""
    inner: str = ""
    """A ``store_pipeline`` tier name (or ``package.module:Class``) to wrap instead of a Posix tier."""
    inner_settings: Mapping[str, Any] = field(default_factory=dict)
    """The settings of ``inner``, as its own ``tier_settings`` entry would hold them."""


_WRAPPER_KEYS = frozenset(f.name for f in dataclasses.fields(WrapperSettings))


def _load(cls: type[Any], name: str, settings: Mapping[str, object]) -> dict[str, Any]:
    """Check ``settings`` against the wrapper's own dataclass ``cls`` (which lists every key)."""
    return load_fields(
        cls,
        settings,
        f"tier_settings.{name}",
        at=lambda key: f"tier_settings.{name}.{key}",
        source="structured",
    )


def wrapped_tier(name: str, settings: Mapping[str, object], context: TierContext) -> Tier:
    """The inner tier a wrapper called ``name`` wraps, from the wrapper's settings."""
    values = _load(WrapperSettings, name, {k: v for k, v in settings.items() if k in _WRAPPER_KEYS})
    if values.get("inner"):
        posix_keys = sorted({"root", "durable", "capacity"} & set(values))
        if posix_keys:
            raise ConfigError(
                f"tier_settings.{name}: {', '.join(posix_keys)} describe the default Posix inner tier; "
                "with inner, put the inner tier's settings in inner_settings"
            )
        return build_tier(values["inner"], values.get("inner_settings", {}), context)
    if "inner_settings" in values:
        raise ConfigError(f"tier_settings.{name}.inner_settings: needs inner (the tier they are for)")
    root = values.get("root", "")
    if not root:
        raise ConfigError(f"tier_settings.{name}.root: a directory for the wrapped Posix tier is required")
    capacity = values.get("capacity", 0)
    return PosixTier(name, roots=[Path(root)], durable=values.get("durable", True), capacity=capacity)


class _PerBlockWrapper(TierWrapper):
    """A wrapper whose change lives in ``read_into``/``write_from``: batches, ``verify`` and the
    one-copy client read go through them (``Tier``'s defaults), so nothing bypasses the change."""

    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        return await Tier.read_many(self, items)

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        return await Tier.write_many(self, items)

    async def read_checked(self, key: BlockKey, dest: IoVec) -> BlockResult | None:
        return None  # read through read_into, into daemon memory

    async def verify(self, key: BlockKey, *, quarantine: bool = True) -> BlockResult:
        return await Tier.verify(self, key, quarantine=quarantine)


@dataclass(frozen=True, slots=True)
class FaultSettings(WrapperSettings):
    """:class:`FaultInjectingTier`'s settings."""

    eio_read_digests: tuple[str, ...] = ()
    """Hex digests (64 characters, any namespace) whose reads fail with EIO; ``"*"`` fails every read."""


class FaultInjectingTier(_PerBlockWrapper):
    """TEST DOUBLE: a real tier whose reads of chosen blocks fail with ``EIO``.

    A medium error cannot be caused portably (device-mapper's ``error`` target is missing in most
    containers), so this fails the read of a chosen block exactly where a failing disk would: after
    the tier found the block (a missing block is still MISSING, a wrong length still the tier's own
    answer), before any payload byte is copied, with the reason a Posix tier gives for ``EIO``, and
    counted in ``stats().errors`` (and ``extra["injected_eio"]``).

    Settings (``tier_settings``): ``root`` (directory of the wrapped Posix tier), ``durable``,
    ``capacity`` — or ``inner`` and ``inner_settings`` for any other tier — and ``eio_read_digests``
    — hex digests (64 characters, any namespace) whose reads fail; ``"*"`` in the list fails every read.
    """

    kind: ClassVar[str] = "FaultInjecting"
    Settings: ClassVar[type[Any] | None] = FaultSettings

    def __init__(self, inner: Tier, eio_read_digests: Sequence[str] = ()) -> None:
        super().__init__(inner)
        self.fail_all = "*" in eio_read_digests
        self.fail_digests = {bytes.fromhex(d) for d in eio_read_digests if d != "*"}
        self.injected = 0

    @classmethod
    def from_settings(
        cls, name: str, settings: Mapping[str, object], context: TierContext = DEFAULT_CONTEXT
    ) -> Self:
        digests: tuple[str, ...] = _load(FaultSettings, name, settings).get("eio_read_digests", ())
        try:
            for d in digests:
                if d != "*":
                    bytes.fromhex(d)
        except ValueError as exc:
            raise ConfigError(f"tier_settings.{name}.eio_read_digests: not hexadecimal ({exc})") from exc
        return cls(wrapped_tier(name, settings, context), digests)

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        if not (self.fail_all or key.digest in self.fail_digests):
            return await self.inner.read_into(key, dest)
        (size,) = await self.inner.lookup([key])
        if size is None or size != iov_len(dest):  # MISSING or a length mismatch: the tier's own answer
            return await self.inner.read_into(key, dest)
        self.injected += 1
        return failed(f"{self.name} read error: {os.strerror(errno.EIO)}")

    def stats(self) -> TierStats:
        s = super().stats()
        s.errors += self.injected
        s.extra = {**s.extra, "injected_eio": float(self.injected)}
        return s


@dataclass(frozen=True, slots=True)
class LatencySettings(WrapperSettings):
    """:class:`LatencyInjectingTier`'s settings."""

    read_delay_s: float = 0.0
    """Seconds each block read takes longer, in [0, 60]."""
    write_delay_s: float = 0.0
    """Seconds each block write takes longer, in [0, 60]."""
    blocking: bool = False
    """The delay holds one of the daemon's I/O threads (``io_threads``), as a disk whose calls block
    does, instead of sleeping on the event loop: work queued behind it in the pool waits too."""


class LatencyInjectingTier(_PerBlockWrapper):
    """TEST DOUBLE: a real tier behind a slow device (fixed delay per block read / write).

    A slow disk cannot be made on demand in a test container. The delay is an ``asyncio.sleep``,
    which models what a slow disk does to the daemon: the operation takes long, while the event loop
    (real disk work runs in the thread pool) stays free to answer others. A read sleeps *after* its
    bytes are copied, since a real slow read returns what the file held when it was opened, even if
    a newer version is renamed over it meanwhile; a write sleeps *before*, since a real slow write
    becomes visible only when it ends.

    With ``blocking`` the delay is a ``time.sleep`` in the daemon's I/O thread pool instead: a disk
    whose every call holds a thread for that long, so the pool's queue (and its order, see
    :mod:`ucm_server.store.io_classes`) decides who waits.

    Settings: ``root``, ``durable``, ``capacity`` as for the Posix tier (or ``inner`` and
    ``inner_settings``), ``read_delay_s`` / ``write_delay_s`` (seconds per block, default 0) and
    ``blocking``.
    """

    kind: ClassVar[str] = "LatencyInjecting"
    Settings: ClassVar[type[Any] | None] = LatencySettings

    def __init__(
        self,
        inner: Tier,
        *,
        read_delay_s: float = 0.0,
        write_delay_s: float = 0.0,
        blocking: bool = False,
        executor: Executor | None = None,
    ) -> None:
        super().__init__(inner)
        self.read_delay_s = read_delay_s
        self.write_delay_s = write_delay_s
        self.blocking = blocking
        self._executor = executor

    @classmethod
    def from_settings(
        cls, name: str, settings: Mapping[str, object], context: TierContext = DEFAULT_CONTEXT
    ) -> Self:
        values = _load(LatencySettings, name, settings)
        delays: dict[str, float] = {}
        for key in ("read_delay_s", "write_delay_s"):
            value = values.get(key, 0.0)
            if not 0 <= value <= 60:
                raise ConfigError(f"tier_settings.{name}.{key}: expected seconds in [0, 60], got {value!r}")
            delays[key] = value
        inner = wrapped_tier(name, settings, context)
        return cls(inner, **delays, blocking=values.get("blocking", False), executor=context.executor)

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        result = await self.inner.read_into(key, dest)
        if self.read_delay_s:
            await self._delay(self.read_delay_s)
        return result

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        if self.write_delay_s:
            await self._delay(self.write_delay_s)
        return await self.inner.write_from(key, src)

    async def _delay(self, seconds: float) -> None:
        if self.blocking:
            await asyncio.get_running_loop().run_in_executor(self._executor, time.sleep, seconds)
        else:
            await asyncio.sleep(seconds)
