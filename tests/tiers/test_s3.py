"""S3Tier against a real Ceph RGW on loopback (one mon + one memstore OSD + RGW, ~13 s to start)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.services import CephRGW, ServiceUnavailable, free_port, start_ceph_rgw
from ucm_protocol.errors import ConfigError, Unavailable
from ucm_protocol.keys import BlockKey, Digest, Namespace
from ucm_protocol.states import BlockState
from ucm_server.store.base import Tier
from ucm_server.store.copying import IoVec
from ucm_server.store.format import HEADER_SIZE, encode_header, payload_checksum
from ucm_server.store.s3 import S3Tier
from ucm_server.testing.shared_tier_machine import NODES, SharedTierMachine, TwoNodes
from ucm_server.testing.tier_suite import TierSuite

pytestmark = pytest.mark.services

boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install boto3)")


@pytest.fixture(scope="module")
def rgw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CephRGW]:
    try:
        server = start_ceph_rgw(tmp_path_factory.mktemp("ceph"))
    except ServiceUnavailable as exc:
        pytest.skip(f"Ceph RGW unavailable: {exc}")
    yield server
    server.stop()


def tier(rgw: CephRGW, name: str, **kw: Any) -> S3Tier:
    settings: dict[str, Any] = {
        "endpoint_url": rgw.endpoint,
        "bucket": "ucm-test",
        "access_key": rgw.access_key,
        "secret_key": rgw.secret_key,
        "prefix": f"t-{uuid.uuid4().hex[:8]}",
        "timeout_s": 5.0,
        "max_workers": 8,
    }
    settings.update(kw)
    return S3Tier(name, **settings)


def raw_client(rgw: CephRGW) -> Any:
    """boto3 itself: how a foreign or buggy writer would put objects under our names."""
    return boto3.client(
        "s3",
        endpoint_url=rgw.endpoint,
        aws_access_key_id=rgw.access_key,
        aws_secret_access_key=rgw.secret_key,
        region_name="us-east-1",
    )


class TestS3Conformance(TierSuite):
    @pytest.fixture(autouse=True)
    def _server(self, rgw: CephRGW) -> None:
        self.rgw = rgw

    async def make_tier(self, path: Path) -> Tier:
        # One prefix per test directory, so the reopen test finds its blocks and no other test's.
        return tier(self.rgw, "Suite", prefix="suite-" + hashlib.sha256(str(path).encode()).hexdigest()[:12])

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        """The object under the block's name, fetched by boto3 itself (not the tier's client)."""
        assert isinstance(tier, S3Tier)
        raw = raw_client(self.rgw)

        def fetch() -> bytes | None:
            try:
                body: bytes = raw.get_object(Bucket="ucm-test", Key=tier.object_name(key))["Body"].read()
            except raw.exceptions.NoSuchKey:
                return None
            return body

        return await asyncio.to_thread(fetch)


def keys(n: int) -> list[BlockKey]:
    space = Namespace(os.urandom(16))
    return [BlockKey(space, Digest(os.urandom(32))) for _ in range(n)]


def scattered(data: bytes, parts: int = 3) -> IoVec:
    step = max(1, len(data) // parts)
    bounds = [*range(0, len(data), step), len(data)]
    return [memoryview(bytearray(data[a:b])) for a, b in itertools.pairwise(bounds) if b > a]


def joined(iov: IoVec) -> bytes:
    return b"".join(bytes(m) for m in iov)


def test_batch_round_trip_and_misses(rgw: CephRGW) -> None:
    async def scenario() -> None:
        t = tier(rgw, "A")
        await t.open()
        try:
            ks = keys(20)
            blobs = [os.urandom(1000 + 3000 * i) for i in range(len(ks))]
            assert all(r.ok for r in await t.write_many(list(zip(ks, map(scattered, blobs), strict=True))))
            (absent,) = keys(1)
            assert await t.lookup([*ks, absent]) == [*map(len, blobs), None]
            dests = [scattered(bytes(len(b)), 4) for b in blobs]
            results = await t.read_many([*zip(ks, dests, strict=True), (absent, [memoryview(bytearray(5))])])
            assert [r.state for r in results] == [BlockState.OK] * len(ks) + [BlockState.MISSING]
            assert [joined(d) for d in dests] == blobs
            s = t.stats()
            assert s.errors == 0 and s.read_bytes == s.write_bytes == sum(map(len, blobs))
        finally:
            await t.close()

    asyncio.run(scenario())


def test_corrupt_or_misnamed_objects_are_failed_never_served(rgw: CephRGW) -> None:
    async def scenario() -> None:
        t = tier(rgw, "A")
        await t.open()
        raw = raw_client(rgw)
        try:
            flipped, misnamed, truncated, other = keys(4)
            payload = os.urandom(8192)
            header = encode_header(flipped, len(payload), payload_checksum([memoryview(payload)]))
            bad = bytearray(header + payload)
            bad[HEADER_SIZE + 100] ^= 1
            raw.put_object(Bucket="ucm-test", Key=t.object_name(flipped), Body=bytes(bad))
            good_elsewhere = encode_header(other, len(payload), payload_checksum([memoryview(payload)]))
            raw.put_object(Bucket="ucm-test", Key=t.object_name(misnamed), Body=good_elsewhere + payload)
            raw.put_object(Bucket="ucm-test", Key=t.object_name(truncated), Body=header[:50])
            dests = [[memoryview(bytearray(len(payload)))] for _ in range(3)]
            results = await t.read_many(list(zip((flipped, misnamed, truncated), dests, strict=True)))
            assert [r.state for r in results] == [BlockState.FAILED] * 3, results
            assert "checksum" in results[0].reason
            assert "expected" in results[1].reason
            assert "truncated" in results[2].reason
            assert all(joined(d) == bytes(len(payload)) for d in dests), "corrupt bytes reached the reader"
            assert t.stats().corrupt == 3
        finally:
            await t.close()

    asyncio.run(scenario())


def test_wrong_credentials_fail_open_naming_endpoint_not_secret(
    rgw: CephRGW, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "not-the-secret-" + uuid.uuid4().hex
    t = tier(rgw, "A", secret_key=secret)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConfigError) as info:
        asyncio.run(t.open())
    message = str(info.value)
    assert rgw.endpoint in message and "ucm-test" in message
    assert secret not in message and secret not in caplog.text and secret not in repr(t)


def test_credentials_from_environment(rgw: CephRGW, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", rgw.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", rgw.secret_key)

    async def scenario() -> None:
        t = tier(rgw, "A", access_key="", secret_key="")
        await t.open()
        try:
            (k,) = keys(1)
            assert (await t.write_from(k, [memoryview(b"env" * 100)])).ok
        finally:
            await t.close()

    asyncio.run(scenario())


def test_missing_bucket_without_create_is_a_config_error(rgw: CephRGW) -> None:
    t = tier(rgw, "A", bucket=f"absent-{uuid.uuid4().hex[:8]}", create_bucket=False)
    with pytest.raises(ConfigError, match="does not exist"):
        asyncio.run(t.open())


def test_unreachable_endpoint_is_unavailable_quickly() -> None:
    port = free_port()
    t = S3Tier(
        "A", endpoint_url=f"http://127.0.0.1:{port}", access_key="a", secret_key="b", timeout_s=1.0, retries=0
    )
    started = time.monotonic()
    with pytest.raises(Unavailable, match=f"127.0.0.1:{port}"):
        asyncio.run(t.open())
    assert time.monotonic() - started < 5


def test_two_daemons_share_blocks(rgw: CephRGW) -> None:
    async def scenario() -> None:
        prefix = f"shared-{uuid.uuid4().hex[:8]}"
        a, b = tier(rgw, "A", prefix=prefix), tier(rgw, "B", prefix=prefix)
        await a.open()
        await b.open()
        try:
            ks = keys(8)
            blobs = [os.urandom(50_000 + i) for i in range(len(ks))]
            assert all(r.ok for r in await a.write_many(list(zip(ks, map(scattered, blobs), strict=True))))
            assert await b.lookup(ks) == list(map(len, blobs))
            dests = [[memoryview(bytearray(len(x)))] for x in blobs]
            assert all(r.ok for r in await b.read_many(list(zip(ks, dests, strict=True))))
            assert [joined(d) for d in dests] == blobs
            assert {i.key async for i in b.list_blocks(ks[0].namespace)} == set(ks)
            assert await b.delete(ks[:3]) == 3
            assert await a.lookup(ks[:4]) == [None, None, None, len(blobs[3])]
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_concurrent_writes_by_two_daemons_leave_one_intact_object(rgw: CephRGW) -> None:
    async def scenario() -> None:
        prefix = f"race-{uuid.uuid4().hex[:8]}"
        a, b = tier(rgw, "A", prefix=prefix), tier(rgw, "B", prefix=prefix)
        await a.open()
        await b.open()
        try:
            for _ in range(6):
                (k,) = keys(1)
                va, vb = os.urandom(256 << 10), os.urandom(256 << 10)
                ra, rb = await asyncio.gather(
                    a.write_from(k, [memoryview(va)]), b.write_from(k, [memoryview(vb)])
                )
                assert ra.ok and rb.ok
                for reader in (a, b):
                    out = bytearray(len(va))
                    assert (await reader.read_into(k, [memoryview(out)])).ok
                    assert bytes(out) in (va, vb)
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


async def _seed(t: S3Tier, blocks: list[tuple[BlockKey, bytes]]) -> None:
    """Write with default timeouts: the first PUTs into a fresh RGW create its data pools (seconds)."""
    await t.open()
    try:
        assert all(r.ok for r in await t.write_many([(k, [memoryview(d)]) for k, d in blocks]))
    finally:
        await t.close()


def test_gateway_down_fails_per_block_within_timeout_then_recovers(rgw: CephRGW) -> None:
    async def scenario() -> None:
        ks = keys(6)
        prefix = f"fault-{uuid.uuid4().hex[:8]}"
        await _seed(tier(rgw, "seed", prefix=prefix), [(k, b"v" * 4096) for k in ks])
        t = tier(rgw, "A", prefix=prefix, timeout_s=1.0, retries=0)
        await t.open()
        try:
            rgw.kill()
            try:
                started = time.monotonic()
                writes = await t.write_many([(k, [memoryview(b"w" * 4096)]) for k in ks])
                reads = await t.read_many([(k, [memoryview(bytearray(4096))]) for k in ks])
                sizes = await t.lookup(ks)
                elapsed = time.monotonic() - started
            finally:
                rgw.restart()
            assert elapsed < 3 * 1.0 + 2, f"took {elapsed:.1f}s with timeout_s=1"
            assert [r.state for r in writes + reads] == [BlockState.FAILED] * 12
            assert all(r.reason for r in writes + reads)
            assert sizes == [None] * 6
            assert t.stats().errors >= 18
            out = bytearray(4096)
            assert (await t.read_into(ks[0], [memoryview(out)])).ok  # same tier object, no re-open
            assert bytes(out) == b"v" * 4096
        finally:
            await t.close()

    asyncio.run(scenario())


def test_hung_gateway_fails_within_timeout_then_recovers(rgw: CephRGW) -> None:
    async def scenario() -> None:
        ks = keys(4)
        prefix = f"fault-{uuid.uuid4().hex[:8]}"
        await _seed(tier(rgw, "seed", prefix=prefix), [(k, b"g" * 4096) for k in ks])
        t = tier(rgw, "A", prefix=prefix, timeout_s=1.0, retries=0)
        await t.open()
        try:
            rgw.pause()
            try:
                started = time.monotonic()
                reads = await t.read_many([(k, [memoryview(bytearray(4096))]) for k in ks])
                sizes = await t.lookup(ks)
                elapsed = time.monotonic() - started
            finally:
                rgw.resume()
            assert elapsed < 2 * 1.0 + 2, f"took {elapsed:.1f}s with timeout_s=1 against a hung gateway"
            assert [r.state for r in reads] == [BlockState.FAILED] * 4
            assert sizes == [None] * 4
            deadline = time.monotonic() + 20
            while True:
                out = bytearray(4096)
                result = await t.read_into(ks[0], [memoryview(out)])
                if result.ok:
                    break
                assert time.monotonic() < deadline, f"no recovery after the gateway resumed: {result}"
                await asyncio.sleep(0.5)
            assert bytes(out) == b"g" * 4096
        finally:
            await t.close()

    asyncio.run(scenario())


def test_from_settings_validates_and_hides_secrets() -> None:
    t = S3Tier.from_settings(
        "S", {"bucket": "b", "endpoint_url": "http://x:1", "timeout_s": 2, "max_workers": "4"}
    )
    assert (t.bucket, t.timeout_s, t.max_workers) == ("b", 2.0, 4)
    with pytest.raises(ConfigError, match="'bukket'"):
        S3Tier.from_settings("S", {"bukket": "b"})
    with pytest.raises(ConfigError, match="'secret_key'") as info:
        S3Tier.from_settings("S", {"secret_key": 12345})
    assert "12345" not in str(info.value)
    with pytest.raises(ConfigError, match="together"):
        S3Tier.from_settings("S", {"access_key": "only-half"})
    assert S3Tier.shared and S3Tier.persistent


def test_silent_endpoint_times_out_instead_of_hanging() -> None:
    """A server that accepts connections but never answers (a hung gateway) must not stall open()."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        t = S3Tier(
            "A",
            endpoint_url=f"http://127.0.0.1:{port}",
            access_key="a",
            secret_key="b",
            timeout_s=0.5,
            retries=0,
        )
        started = time.monotonic()
        with pytest.raises(Unavailable, match=f"127.0.0.1:{port}"):
            asyncio.run(t.open())
        assert time.monotonic() - started < 4


def test_two_daemons_share_blocks_through_a_cache_s3_pipeline(rgw: CephRGW, tmp_path: Path) -> None:
    """The product path: two real ucm-server processes with ``Cache|S3`` on one bucket; a block dumped
    on node A is loaded on node B, whose own Cache never saw it."""
    import yaml

    from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
    from ucm_server.testing.daemon import DaemonProcess

    settings = {
        "endpoint_url": rgw.endpoint,
        "bucket": "ucm-e2e",
        "access_key": rgw.access_key,
        "secret_key": rgw.secret_key,
        "prefix": f"e2e-{uuid.uuid4().hex[:6]}",
    }
    config = tmp_path / "node.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "store_pipeline": "Cache|S3",
                "write_mode": "write-through",
                "cache_capacity": "64MiB",
                "tier_settings": {"S3": settings},
            }
        )
    )
    config.chmod(0o600)
    ns = namespace_id(model="e2e-s3", dtype="uint8")
    n, size = 8, 128 << 10

    def blocks(region: int) -> list[BlockIO]:
        return [BlockIO(key_digest("e2e", i), (Segment(region, i * size, size),)) for i in range(n)]

    with (
        DaemonProcess(tmp_path / "a", args=["--config", str(config)]) as node_a,
        DaemonProcess(tmp_path / "b", args=["--config", str(config)]) as node_b,
        UcmClient(node_a.target, client_name="node-a") as ca,
        UcmClient(node_b.target, client_name="node-b") as cb,
        SharedBuffer(n * size) as src,
        SharedBuffer(n * size) as dst,
    ):
        src.buf[:] = os.urandom(n * size)
        ra, rb = ca.register(src), cb.register(dst)
        dumped = ca.wait(ca.dump(ns, blocks(ra)), 30)
        assert dumped.ok, dumped.reasons
        assert cb.lookup(ns, [b.key for b in blocks(rb)]).hit_prefix == n
        loaded = cb.wait(cb.load(ns, blocks(rb)), 30)
        assert loaded.ok, loaded.reasons
        assert bytes(dst.buf) == bytes(src.buf)
        for log in (node_a.log_path, node_b.log_path):
            assert rgw.secret_key not in log.read_text(), "the S3 secret reached the daemon log"


# -- two daemons, one bucket, one model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes(rgw: CephRGW) -> Iterator[TwoNodes]:
    nodes = TwoNodes([tier(rgw, n) for n in ("A", "B")])
    NODES.append(nodes)
    yield nodes
    NODES.remove(nodes)
    nodes.close()


class TwoDaemonsOneBucket(SharedTierMachine):
    """Two daemons on one bucket: the tier keeps no cache that could go stale."""

    def isolate(self, tier: Tier, prefix: str) -> None:
        tier.prefix = prefix  # type: ignore[attr-defined]


TestTwoDaemonsOneBucket = pytest.mark.usefixtures("two_nodes")(TwoDaemonsOneBucket.TestCase)
TestTwoDaemonsOneBucket.settings = settings(max_examples=15, stateful_step_count=15, deadline=None)
