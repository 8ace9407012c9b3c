"""The fault-injecting test doubles are faithful wrappers: with no fault configured they pass the
conformance suite every tier passes, and their settings are checked like any tier's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ucm_protocol.errors import ConfigError
from ucm_protocol.keys import BlockKey
from ucm_server.store.base import Tier
from ucm_server.store.posix import PosixTier
from ucm_server.testing.faults import FaultInjectingTier, LatencyInjectingTier
from ucm_server.testing.tier_suite import TierSuite


async def inner_file(tier: Tier, key: BlockKey) -> bytes | None:
    """A wrapper's back door: the wrapped Posix tier's block file, read with plain file I/O."""
    assert isinstance(tier, FaultInjectingTier | LatencyInjectingTier)
    assert isinstance(tier.inner, PosixTier)
    path = tier.inner.path_of(key)
    return await asyncio.to_thread(path.read_bytes) if path.exists() else None


class TestFaultInjectingTierConformance(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        return FaultInjectingTier.from_settings("Faulty", {"root": str(path / "blocks")})

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        return await inner_file(tier, key)


class TestLatencyInjectingTierConformance(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        settings = {"root": str(path / "blocks"), "read_delay_s": 0.001, "write_delay_s": 0.001}
        return LatencyInjectingTier.from_settings("Slow", settings)

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        return await inner_file(tier, key)


@pytest.mark.parametrize(
    ("cls", "settings", "named"),
    [
        (FaultInjectingTier, {}, "root"),
        (FaultInjectingTier, {"root": "/x", "eio_read_digests": ["zz"]}, "eio_read_digests"),
        (FaultInjectingTier, {"root": "/x", "typo": 1}, "unknown key"),
        (LatencyInjectingTier, {"root": "/x", "read_delay_s": -1}, "read_delay_s"),
        (LatencyInjectingTier, {"root": "/x", "capacity": "big"}, "capacity"),
    ],
)
def test_bad_settings_are_config_errors(cls: type[Tier], settings: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        cls.from_settings("T", settings)  # type: ignore[attr-defined]
