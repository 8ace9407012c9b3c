"""The fault-injecting test doubles are faithful wrappers: with no fault configured they pass the
conformance suite every tier passes, and their settings are checked like any tier's."""

from __future__ import annotations

from pathlib import Path

import pytest

from ucm_server.api.errors import ConfigError
from ucm_server.store.base import Tier
from ucm_server.testing.faults import FaultInjectingTier, LatencyInjectingTier
from ucm_server.testing.tier_suite import TierSuite


class TestFaultInjectingTierConformance(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        return FaultInjectingTier.from_settings("Faulty", {"root": str(path / "blocks")})


class TestLatencyInjectingTierConformance(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        settings = {"root": str(path / "blocks"), "read_delay_s": 0.001, "write_delay_s": 0.001}
        return LatencyInjectingTier.from_settings("Slow", settings)


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
