"""Red team: RPC fields and call orders the client library would not send, against a real daemon.

Found and fixed here:

- ``UnregisterRegion`` returned at once while a Load into the region ran on: every block of the load
  landed in memory the client had taken back (the task even reported OK). Now the call cancels the
  session's tasks using the region and returns once they stopped, as ``Cancel`` does.
- ``Evict`` with several targets ran one and ignored the rest (keys + all evicted only the keys; all +
  min_bytes evicted everything), and ``all`` with a namespace of the wrong size matched nothing and
  answered OK. Now each is INVALID_ARGUMENT naming the fields.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.blocks import NS
from support.slow_tier import slow_daemon

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

SIZE = 4096
N = 600  # three chunks (256 blocks each at most, two copied at once): a cancel point before the third
SENTINEL = b"\x5a"


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon whose only tier sleeps 10 ms per block: a 600-block task runs for about a second."""
    with slow_daemon(tmp_path_factory.mktemp("rt-rpc"), 0.01) as d:
        yield d


def _blocks(region: int, tag: str) -> list[BlockIO]:
    return [BlockIO(key_digest(tag, i), (seg(region, i),)) for i in range(N)]


def seg(region: int, i: int) -> Segment:
    return Segment(region, i * SIZE, SIZE)


def _content(i: int) -> bytes:
    return i.to_bytes(4, "little") * (SIZE // 4)


def _untouched_since(buf: SharedBuffer) -> int:
    """Blocks of ``buf`` that are no longer all SENTINEL."""
    return sum(1 for i in range(N) if bytes(buf.buf[i * SIZE : (i + 1) * SIZE]) != SENTINEL * SIZE)


def _dumped(c: UcmClient, tag: str) -> None:
    with SharedBuffer(N * SIZE) as src:
        for i in range(N):
            src.buf[i * SIZE : (i + 1) * SIZE] = _content(i)
        assert c.wait(c.dump(NS, _blocks(c.register(src), tag)), 60).ok


@pytest.mark.parametrize("unregister", [True, False], ids=["unregistered", "control"])
def test_no_load_writes_into_memory_after_its_region_is_unregistered(
    slow: DaemonProcess, unregister: bool
) -> None:
    tag = f"rt-unreg-load-{unregister}"
    with UcmClient(slow.target, client_name=tag) as c, SharedBuffer(N * SIZE) as buf:
        _dumped(c, tag)
        region = c.register(buf)
        task = c.load(NS, _blocks(region, tag))
        time.sleep(0.1)
        assert not c.check(task).done, "the load ended before the test could act: make the tier slower"
        if unregister:
            started = time.monotonic()
            c.unregister(region)
            assert time.monotonic() - started < 10
        buf.buf[:] = SENTINEL * (N * SIZE)  # the client takes its memory back
        result = c.wait(task, 60)
        assert result.done
        if unregister:
            assert _untouched_since(buf) == 0  # nothing landed after UnregisterRegion returned
            assert set(result.states) <= {BlockState.OK, BlockState.CANCELLED}
            assert BlockState.CANCELLED in result.states  # the second chunk never ran
        else:  # control: without the unregister, the load does write over the sentinel
            assert result.ok and _untouched_since(buf) > 0
    assert slow.healthy()


def test_a_dump_never_stores_memory_rewritten_after_the_unregister(slow: DaemonProcess) -> None:
    tag = "rt-unreg-dump"
    with UcmClient(slow.target, client_name=tag) as c:
        with SharedBuffer(N * SIZE) as src:
            for i in range(N):
                src.buf[i * SIZE : (i + 1) * SIZE] = _content(i)
            region = c.register(src)
            task = c.dump(NS, _blocks(region, tag))
            time.sleep(0.1)
            c.unregister(region)
            src.buf[:] = SENTINEL * (N * SIZE)
            result = c.wait(task, 60)
        assert set(result.states) <= {BlockState.OK, BlockState.CANCELLED}
        stored = result.indices(BlockState.OK)
        with SharedBuffer(N * SIZE) as out:
            back = c.register(out)
            got = c.wait(c.load(NS, [_blocks(back, tag)[i] for i in stored]), 60)
            assert got.ok
            for j, i in enumerate(stored):  # a stored block holds what the memory held before
                assert bytes(out.buf[j * SIZE : (j + 1) * SIZE]) == _content(i), i
    assert slow.healthy()


# -- Evict ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("rt-evict") / "ucm", args=["--cache-capacity", "16MiB"]) as d:
        yield d


def _cache_blocks(admin: rpc.AdminStub) -> int:
    return next(t.blocks for t in admin.Stats(pb.StatsRequest(), timeout=5).tiers if t.name == "Cache")


K = [key_digest("rt-evict", i) for i in range(4)]
CONFLICTS = {
    "keys + all": (pb.EvictRequest(tier="Cache", namespace=NS, keys=K[:1], all=True), "got keys, all"),
    "keys + min_bytes": (
        pb.EvictRequest(tier="Cache", namespace=NS, keys=K[:1], min_bytes=1),
        "got keys, min_bytes",
    ),
    "all + min_bytes": (pb.EvictRequest(tier="Cache", all=True, min_bytes=4096), "got min_bytes, all"),
    "min_bytes + namespace": (
        pb.EvictRequest(tier="Cache", namespace=NS, min_bytes=1),
        "namespace narrows keys or all, not min_bytes",
    ),
    "all + 3-byte namespace": (
        pb.EvictRequest(tier="Cache", namespace=b"abc", all=True),
        "namespace must be 16 bytes, got 3",
    ),
}


@pytest.mark.parametrize("case", list(CONFLICTS))
def test_evict_with_conflicting_targets_is_refused_and_evicts_nothing(
    daemon: DaemonProcess, case: str
) -> None:
    request, message = CONFLICTS[case]
    with (
        UcmClient(daemon.target) as c,
        SharedBuffer(4 * SIZE) as buf,
        grpc.insecure_channel(daemon.target) as ch,
    ):
        region = c.register(buf)
        assert c.wait(
            c.dump(NS, [BlockIO(k, (Segment(region, i * SIZE, SIZE),)) for i, k in enumerate(K)]), 10
        ).ok
        admin = rpc.AdminStub(ch)
        before = _cache_blocks(admin)
        assert before >= len(K)
        with pytest.raises(grpc.RpcError) as info:
            admin.Evict(request, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (info.value.details() or "")
        assert _cache_blocks(admin) == before  # nothing evicted
        # control: each target alone works
        one = admin.Evict(pb.EvictRequest(tier="Cache", namespace=NS, keys=K[:1]), timeout=5)
        assert one.blocks == 1
        assert (
            admin.Evict(pb.EvictRequest(tier="Cache", namespace=NS, all=True), timeout=5).blocks == len(K) - 1
        )
    assert daemon.healthy()


def _memfd_mappings(pid: int) -> int:
    """The client memory (memfds the client library names ``ucm-...``) the daemon still maps."""
    return sum(1 for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "memfd:ucm-" in line)


@pytest.mark.slow
def test_tasks_cancelled_while_queued_release_the_clients_memory(tmp_path: Path) -> None:
    """A task cancelled before a slot freed up (64 run at once) never ran its body, where its region
    pins were released: the daemon kept the client's memory mapped after the client unregistered it
    and left (one mapping per such region, for the daemon's lifetime)."""
    # 1 s per block: 80 dump calls, one round trip each, are all made before the first task ends,
    # however slow a loaded machine makes the round trips (0.1 s let the first ones end: none queued)
    with slow_daemon(tmp_path, 1.0) as d, UcmClient(d.target, client_name="rt-queued") as c:
        assert d.proc is not None
        with SharedBuffer(100 * SIZE) as buf:
            region = c.register(buf)
            tasks = [c.dump(NS, [BlockIO(key_digest("rt-queued", t), (seg(region, t),))]) for t in range(80)]
            assert c.stats().tasks_queued > 0, "no task was queued: make the tier slower"
            assert _memfd_mappings(d.proc.pid) >= 1  # control: the check sees the daemon's mapping
            cancelled = [c.cancel(t) for t in tasks[64:]]
            assert any(BlockState.CANCELLED in r.states for r in cancelled)
            for t in tasks[:64]:
                c.wait(t, 60)
            c.unregister(region)
        deadline = time.monotonic() + 5
        while _memfd_mappings(d.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _memfd_mappings(d.proc.pid) == 0
        assert d.healthy()
