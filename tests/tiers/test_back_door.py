"""The conformance suite's back-door read catches symmetric bugs that reading back through the tier
cannot (issue #12: "the tier conformance suite gains a back-door read of what a tier stored").

Each test double below is a real Posix tier with one deliberate bug that its own read path undoes; the
suite's ordinary tests pass on it, and ``test_stored_bytes_are_the_payload`` fails, naming the bug. A
suite without the hook skips that test instead of failing third-party tiers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from ucm_protocol.keys import BlockKey
from ucm_server.store import format as block_format
from ucm_server.store.base import BlockResult, IoVec, Tier, copy_iov
from ucm_server.store.posix import PosixTier, files
from ucm_server.testing.tier_suite import TierSuite

_XOR = bytes(b ^ 0x5A for b in range(256))


class ScramblingPosixTierDouble(PosixTier):
    """Test double: stores each payload byte XOR 0x5A, un-XORs on read (symmetric: round trips pass)."""

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        scrambled = b"".join(bytes(seg) for seg in src).translate(_XOR)
        return await super().write_from(key, [memoryview(scrambled)])

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        size = sum(m.nbytes for m in dest)
        held = bytearray(size)
        result = await super().read_into(key, [memoryview(held)])
        if result.ok:
            copy_iov(dest, [memoryview(bytes(held).translate(_XOR))])
        return result


async def stored_file(tier: Tier, key: BlockKey) -> bytes | None:
    assert isinstance(tier, PosixTier)
    path = tier.path_of(key)
    return path.read_bytes() if path.exists() else None


class ScramblingSuite(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        return ScramblingPosixTierDouble(roots=[path / "blocks"], direct_io=False)

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        return await stored_file(tier, key)


class PlainSuite(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        return PosixTier(roots=[path / "blocks"])

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        return await stored_file(tier, key)


class NoBackDoorSuite(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        return PosixTier(roots=[path / "blocks"])


@pytest.fixture
def wrong_checksum(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Test double for a checksum bug: writer and verifier both use xxh64, not the documented xxh3-64."""

    def xxh64(iov: IoVec) -> int:
        h = xxhash.xxh64()
        for seg in iov:
            h.update(seg)
        return h.intdigest()

    monkeypatch.setattr(block_format, "payload_checksum", xxh64)
    monkeypatch.setattr(files, "payload_checksum", xxh64)
    yield


def test_scrambled_payload_round_trips_but_the_back_door_sees_it(tmp_path: Path) -> None:
    suite = ScramblingSuite()
    suite.test_round_trip(tmp_path / "round-trip")  # the bug is invisible through the tier
    with pytest.raises(AssertionError, match="stored payload is not the bytes written"):
        suite.test_stored_bytes_are_the_payload(tmp_path / "back-door")


def test_wrong_checksum_function_round_trips_but_the_back_door_sees_it(
    tmp_path: Path, wrong_checksum: None
) -> None:
    suite = PlainSuite()
    suite.test_round_trip(tmp_path / "round-trip")
    suite.test_verify_good_block(tmp_path / "verify")  # the tier's own verify agrees with itself
    with pytest.raises(AssertionError, match="checksum is not xxh3-64"):
        suite.test_stored_bytes_are_the_payload(tmp_path / "back-door")


def test_a_suite_without_the_hook_skips_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(pytest.skip.Exception, match=r"no back door: override TierSuite\.stored_block"):
        NoBackDoorSuite().test_stored_bytes_are_the_payload(tmp_path)
