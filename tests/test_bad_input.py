"""A client's mistakes get precise status codes naming what was wrong; the daemon stays healthy."""

from __future__ import annotations

import grpc
import pytest
from support.blocks import NS, blocks_in

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest
from ucm_client.errors import InvalidArgument, NotFound
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess


@pytest.fixture
def raw(daemon: DaemonProcess):  # type: ignore[no-untyped-def]
    """A bare stub with no session, to send requests the client library would never build."""
    with grpc.insecure_channel(daemon.target) as ch:
        yield rpc.KVStoreStub(ch)


@pytest.mark.slow
def test_unknown_region_handle(client: UcmClient, daemon: DaemonProcess) -> None:
    with pytest.raises(InvalidArgument, match="region handle 999 is not registered"):
        client.load(NS, [BlockIO(key_digest(0), (Segment(999, 0, 10),))])
    assert daemon.healthy()


def test_out_of_range_segment_copies_nothing(
    client: UcmClient, shm: SharedBuffer, daemon: DaemonProcess
) -> None:
    region = client.register(shm)
    shm.buf[:4096] = b"\xab" * 4096
    with pytest.raises(InvalidArgument, match=r"block 1: segment \[16773120, 16781312\) is outside region"):
        client.dump(
            NS,
            [
                BlockIO(key_digest(0), (Segment(region, 0, 4096),)),
                BlockIO(key_digest(1), (Segment(region, (16 << 20) - 4096, 8192),)),
            ],
        )
    # The valid first block of the rejected batch was not stored either.
    assert client.lookup(NS, [key_digest(0)]).present == [False]
    assert daemon.healthy()


@pytest.mark.slow
def test_wrong_key_and_namespace_sizes(client: UcmClient, shm: SharedBuffer, daemon: DaemonProcess) -> None:
    region = client.register(shm)
    with pytest.raises(InvalidArgument, match=r"keys\[1\] must be 32 bytes, got 5"):
        client.lookup(NS, [key_digest(0), b"short"])
    with pytest.raises(InvalidArgument, match="namespace must be 16 bytes, got 3"):
        client.lookup(b"abc", [key_digest(0)])
    with pytest.raises(InvalidArgument, match=r"keys\[0\] must be 32 bytes, got 33"):
        client.dump(NS, [BlockIO(b"x" * 33, (Segment(region, 0, 10),))])
    assert daemon.healthy()


@pytest.mark.slow
def test_empty_and_oversized_batches(client: UcmClient, shm: SharedBuffer, daemon: DaemonProcess) -> None:
    client.register(shm)
    with pytest.raises(InvalidArgument, match="empty batch"):
        client.load(NS, [])
    with pytest.raises(InvalidArgument, match="70000 keys in one request; the limit is 65536"):
        client.lookup(NS, [key_digest(i) for i in range(70000)])
    assert daemon.healthy()


def test_block_larger_than_limit(tmp_path, shm: SharedBuffer) -> None:  # type: ignore[no-untyped-def]
    with DaemonProcess(tmp_path / "d", args=["--max-block-bytes", "1MiB"]) as d, UcmClient(d.target) as c:
        region = c.register(shm)
        with pytest.raises(InvalidArgument, match="more than max_block_bytes 1048576"):
            c.dump(NS, [BlockIO(key_digest(0), (Segment(region, 0, 2 << 20),))])
        assert d.healthy()


@pytest.mark.slow
def test_malformed_batches_via_raw_stub(raw: rpc.KVStoreStub, daemon: DaemonProcess) -> None:
    session = raw.Attach(pb.AttachRequest(client_name="raw"))  # the session lives while this stream does
    md = (("ucm-session", next(session).session_id),)
    cases = {
        "equal lengths": pb.BlockBatch(
            namespace=NS, keys=[key_digest(0)], region_ids=[1], offsets=[0, 1], lengths=[1]
        ),
        "segment_counts has 2 entries for 1 keys": pb.BlockBatch(
            namespace=NS,
            keys=[key_digest(0)],
            segment_counts=[1, 1],
            region_ids=[1],
            offsets=[0],
            lengths=[1],
        ),
        "unknown region 77": pb.BlockBatch(
            namespace=NS, keys=[key_digest(0)], region_ids=[77], offsets=[0], lengths=[8]
        ),
    }
    for expected, batch in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            raw.Load(pb.LoadRequest(blocks=batch), metadata=md)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in info.value.details()
    session.cancel()
    assert daemon.healthy()


@pytest.mark.slow
def test_calls_without_session_are_refused(raw: rpc.KVStoreStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        raw.Load(pb.LoadRequest(blocks=pb.BlockBatch(namespace=NS, keys=[key_digest(0)])))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "needs a session" in info.value.details()


def test_unknown_task_and_foreign_region(client: UcmClient, daemon: DaemonProcess) -> None:
    with pytest.raises(NotFound, match="unknown task 424242"):
        client.check(424242)
    with UcmClient(daemon.target) as other, SharedBuffer(4096) as buf:
        other_region = other.register(buf)
        server_id = other.aio._regions[other_region].server_id
        with grpc.insecure_channel(daemon.target) as ch:
            stub = rpc.KVStoreStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                stub.UnregisterRegion(
                    pb.UnregisterRegionRequest(region_id=server_id),
                    metadata=(("ucm-session", client.aio._session_id or ""),),
                )
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert daemon.healthy()


def test_bad_shared_memory_registrations(client: UcmClient, daemon: DaemonProcess) -> None:
    """Memory is registered only as a SharedBuffer the client hands over; names are refused at once
    (the daemon-side refusal of a raw by-name request: tests/security/test_memory_registration.py)."""
    with pytest.raises(InvalidArgument, match="SharedBuffer"):
        client.register("/ucm-no-such-object", 4096)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="SharedBuffer"):
        client.register("../etc/passwd", 4096)  # type: ignore[arg-type]
    with SharedBuffer(4096) as buf:
        with pytest.raises(InvalidArgument, match="holds 4096 bytes"):
            client.register(buf, 8192)
    assert daemon.healthy()


@pytest.mark.slow
def test_daemon_answers_after_all_of_the_above(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    assert client.wait(client.dump(NS, blocks_in(region, 2, 4096)), 10).ok


def test_load_into_a_destination_of_the_wrong_size(
    client: UcmClient, shm: SharedBuffer, daemon: DaemonProcess
) -> None:
    region = client.register(shm)
    assert client.wait(client.dump(NS, blocks_in(region, 2, 4096)), 10).ok
    shm.buf[8192:16384] = b"\x5a" * 8192
    wrong = [
        *blocks_in(region, 1, 4096, offset=8192),
        BlockIO(key_digest("block", 1), (Segment(region, 12288, 2048),)),
    ]
    with pytest.raises(InvalidArgument, match="block 1: stored block is 4096 bytes, the request names 2048"):
        client.load(NS, wrong)
    assert bytes(shm.buf[8192:16384]) == b"\x5a" * 8192  # nothing copied, not even the good block 0
    assert daemon.healthy()
