"""The fault and latency wrappers wrap any tier, not only Posix.

``inner`` (a ``store_pipeline`` tier name) and ``inner_settings`` choose the wrapped tier; without
them the wrapped tier is a Posix tier from ``root``/``durable``/``capacity`` as before. A wrapper has
its inner tier's capabilities (persistent, shared), passes the conformance suite around a Cache and a
DS3FS tier, and injects its fault in a real daemon whatever it wraps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.hardening import FAULT_TIER, admin_evict_all, admin_stats, content, tier_env, tier_named

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_protocol.errors import ConfigError
from ucm_server.store.base import Tier, TierContext
from ucm_server.store.cache import CacheTier
from ucm_server.store.ds3fs import DS3FSTier
from ucm_server.store.posix import PosixTier
from ucm_server.testing.daemon import DaemonProcess
from ucm_server.testing.faults import FaultInjectingTier, LatencyInjectingTier
from ucm_server.testing.tier_suite import TierSuite

NS = namespace_id(test="wrappers-any-tier")
SENTINEL = 0xEE


def _ds3fs_settings(path: Path) -> dict[str, object]:
    (path / "mnt").mkdir(exist_ok=True)
    return {"mount": str(path / "mnt"), "usrbio": "off", "durable": False}


class TestLatencyAroundCacheConformance(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        settings = {"inner": "Cache", "inner_settings": {"capacity": "64MiB"}, "read_delay_s": 0.001}
        return LatencyInjectingTier.from_settings("SlowCache", settings)


class TestFaultAroundDS3FSConformance(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        return FaultInjectingTier.from_settings(
            "FaultyDS3FS", {"inner": "DS3FS", "inner_settings": _ds3fs_settings(path)}
        )


def test_a_wrapper_has_its_inner_tiers_capabilities(tmp_path: Path) -> None:
    slow_cache = LatencyInjectingTier.from_settings(
        "S", {"inner": "Cache", "inner_settings": {"capacity": "4MiB"}}
    )
    assert isinstance(slow_cache.inner, CacheTier)
    assert (slow_cache.persistent, slow_cache.shared) == (False, False)
    faulty = FaultInjectingTier.from_settings(
        "F", {"inner": "DS3FS", "inner_settings": _ds3fs_settings(tmp_path)}
    )
    assert isinstance(faulty.inner, DS3FSTier)
    assert (faulty.persistent, faulty.shared) == (True, True)
    legacy = FaultInjectingTier.from_settings("P", {"root": str(tmp_path / "p"), "capacity": "1MiB"})
    assert isinstance(legacy.inner, PosixTier) and legacy.inner.capacity == 1 << 20
    assert (legacy.persistent, legacy.shared) == (True, False)


def test_the_inner_tier_gets_the_daemons_context(tmp_path: Path) -> None:
    faulty = FaultInjectingTier.from_settings(
        "F",
        {"inner": "DS3FS", "inner_settings": _ds3fs_settings(tmp_path)},
        TierContext(max_block_bytes=4096),
    )
    assert isinstance(faulty.inner, DS3FSTier) and faulty.inner.max_block_bytes == 4096


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"inner": "Tape"}, "unknown tier 'Tape'"),
        ({"inner": "Cache", "root": "/x"}, "root describe the default Posix inner tier"),
        ({"root": "/x", "inner_settings": {"capacity": 1}}, "inner_settings: needs inner"),
        ({"inner": "DS3FS", "inner_settings": {"mnt": "/x"}}, "unknown key 'mnt'"),
        ({"inner": "Cache", "inner_settings": "capacity=1"}, "inner_settings: expected a mapping"),
    ],
)
def test_bad_inner_settings_are_config_errors(settings: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        FaultInjectingTier.from_settings("T", settings)


@pytest.mark.slow
def test_eio_injected_around_a_ds3fs_tier_in_a_real_daemon(tmp_path: Path) -> None:
    """The EIO double around a DS3FS tier (not Posix): the chosen blocks fail with the OS's reason,
    none of their bytes reach the client, the others load intact, the errors are counted, and the
    daemon stays healthy."""
    size, n, bad = 16 << 10, 6, (1, 4)
    keys = [key_digest("eio-ds3fs", i) for i in range(n)]
    settings = {
        "inner": "DS3FS",
        "inner_settings": _ds3fs_settings(tmp_path),
        "eio_read_digests": [keys[i].hex() for i in bad],
    }
    d = DaemonProcess(
        tmp_path / "ucm", args=["--store-pipeline", f"Cache|{FAULT_TIER}"], env=tier_env(FAULT_TIER, settings)
    )
    with d, UcmClient(d.target) as c, SharedBuffer(2 * n * size) as buf:
        region = c.register(buf)
        blocks = []
        for i, k in enumerate(keys):
            buf.buf[i * size : (i + 1) * size] = content(k, size)
            blocks.append(BlockIO(k, (Segment(region, i * size, size),)))
        assert c.wait(c.dump(NS, blocks, wait_durable=True), 30).ok
        assert len(list((tmp_path / "mnt").rglob("*.blk"))) == n  # really stored by the DS3FS tier
        admin_evict_all(d.target, "Cache")
        buf.buf[n * size :] = bytes([SENTINEL]) * (n * size)
        back = [BlockIO(k, (Segment(region, n * size + i * size, size),)) for i, k in enumerate(keys)]
        r = c.wait(c.load(NS, back), 30)
        assert r.indices(BlockState.FAILED) == list(bad), (r.states, r.reasons)
        for i in range(n):
            got = bytes(buf.buf[n * size + i * size : n * size + (i + 1) * size])
            if i in bad:
                assert "Input/output error" in r.reasons[i]
                assert got == bytes([SENTINEL]) * size
            else:
                assert got == content(keys[i], size)
        faulty = tier_named(admin_stats(d.target), "FaultInjecting")
        assert faulty.errors == len(bad) and faulty.extra["injected_eio"] == len(bad)
        assert d.healthy()
