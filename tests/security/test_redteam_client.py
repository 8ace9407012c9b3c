"""Red team: a careless caller of ``UcmClient`` / ``AsyncUcmClient`` gets a typed error naming the argument.

Before, wrong types and out-of-range numbers reached the protobuf runtime and came back as bare
``TypeError`` / ``ValueError: Value out of range: -1`` / ``AttributeError`` naming no argument; a
generator of keys was reported as "this UcmClient is closed"; a NaN timeout (or ``rpc_timeout_s=0``)
turned into an immediate ``DeadlineExceeded``; and an ``AsyncUcmClient`` reopened a session on the next
call after ``close()``. Each case here is checked against a real daemon, with the daemon's lookup
counter showing nothing was sent, and the same call with good arguments as the control.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from support.blocks import NS

from ucm_client import AsyncUcmClient, BlockIO, Segment, SharedBuffer, UcmClient, key_digest
from ucm_client.errors import ArgumentTypeError, FailedPrecondition, InvalidArgument, UcmError
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

K = key_digest("redteam-client")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("rt-client") / "ucm", args=["--cache-capacity", "16MiB"]) as d:
        yield d


@pytest.fixture(scope="module")
def setup(daemon: DaemonProcess) -> Iterator[tuple[UcmClient, int]]:
    with UcmClient(daemon.target, client_name="rt-client") as c, SharedBuffer(1 << 20) as buf:
        region = c.register(buf)
        assert c.wait(c.dump(NS, [BlockIO(K, (Segment(region, 0, 4096),))]), 10).ok
        yield c, region


def _stats(daemon: DaemonProcess) -> pb.StatsResponse:
    """The daemon's own figures, read on a channel of its own (no session)."""
    with grpc.insecure_channel(daemon.target) as ch:
        return rpc.AdminStub(ch).Stats(pb.StatsRequest(), timeout=5)


def seg(region: int, offset: Any = 0, length: Any = 4096) -> Segment:
    return Segment(region, offset, length)


# (call, exception, message): r is the registered region handle
WRONG: dict[str, tuple[Callable[[UcmClient, int], object], type[UcmError], str]] = {
    "str key": (
        lambda c, r: c.lookup(NS, ["k" * 32]),
        ArgumentTypeError,
        r"keys\[0\] must be bytes, got str",
    ),
    "one key, not a list": (
        lambda c, r: c.lookup(NS, K),
        ArgumentTypeError,
        "got one bytes \\(wrap a single key in a list\\)",
    ),
    "int key": (lambda c, r: c.delete(NS, [K, 7]), ArgumentTypeError, r"keys\[1\] must be bytes, got int"),
    "str namespace": (lambda c, r: c.lookup("n" * 16, [K]), ArgumentTypeError, "namespace must be 16 bytes"),
    "None namespace": (lambda c, r: c.prefetch(None, [K]), ArgumentTypeError, "got NoneType"),  # type: ignore[arg-type]
    "tuple block": (
        lambda c, r: c.load(NS, [(K, (r, 0, 10))]),
        ArgumentTypeError,
        r"blocks\[0\] must be a BlockIO",
    ),
    "None blocks": (lambda c, r: c.dump(NS, None), ArgumentTypeError, "blocks must be a sequence of BlockIO"),  # type: ignore[arg-type]
    "negative offset": (
        lambda c, r: c.load(NS, [BlockIO(K, (seg(r, -1),))]),
        InvalidArgument,
        r"blocks\[0\]\.segments\[0\]\.offset must be in \[0, 18446744073709551616\), got -1",
    ),
    "float offset": (
        lambda c, r: c.load(NS, [BlockIO(K, (seg(r, 0.5),))]),
        ArgumentTypeError,
        r"blocks\[0\]\.segments\[0\]\.offset must be an integer, got float",
    ),
    "2**70 length": (
        lambda c, r: c.dump(NS, [BlockIO(K, (seg(r, 0, 4096),)), BlockIO(K, (seg(r, 0, 2**70),))]),
        InvalidArgument,
        r"blocks\[1\]\.segments\[0\]\.length must be in",
    ),
    "str task id": (lambda c, r: c.wait("1", 1), ArgumentTypeError, "task_id must be an integer, got str"),  # type: ignore[arg-type]
    "negative task id": (lambda c, r: c.check(-1), InvalidArgument, r"task_id must be in \[0, "),
    "2**64 task id": (lambda c, r: c.cancel(2**64), InvalidArgument, "task_id must be in"),
    "NaN timeout": (
        lambda c, r: c.wait(1, math.nan),
        InvalidArgument,
        "timeout_s must be a number of seconds, got nan",
    ),
    "str timeout": (
        lambda c, r: c.wait(1, "5"),
        ArgumentTypeError,
        "timeout_s must be a number of seconds, got str",
    ),  # type: ignore[arg-type]
    "float register size": (
        lambda c, r: c.register(SharedBuffer(4096), 1.5),  # type: ignore[arg-type]
        ArgumentTypeError,
        "size must be an integer, got float",
    ),
    "str pin": (
        lambda c, r: c.set_retention(NS, [K], pin="yes"),
        ArgumentTypeError,
        "pin must be True, False or None",
    ),  # type: ignore[arg-type]
    "NaN ttl": (
        lambda c, r: c.set_retention(NS, [K], ttl_s=math.nan),
        InvalidArgument,
        "ttl_s must be a number",
    ),
    "str data": (
        lambda c, r: c.put_blocks(NS, [(K, "data")]),
        ArgumentTypeError,
        r"items\[0\] data must be bytes, got str",
    ),  # type: ignore[list-item]
    "str get key": (
        lambda c, r: c.get_blocks(NS, ["k"]),
        ArgumentTypeError,
        r"keys\[0\] must be bytes, got str",
    ),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_argument_is_a_typed_error_naming_it(
    setup: tuple[UcmClient, int], daemon: DaemonProcess, case: str
) -> None:
    c, region = setup
    call, exc_type, message = WRONG[case]
    before = _stats(daemon).lookups
    with pytest.raises(exc_type, match=message) as info:
        call(c, region)
    assert isinstance(info.value, UcmError)
    if exc_type is ArgumentTypeError:
        assert isinstance(info.value, TypeError)  # what Python code catches for a wrong type
    assert _stats(daemon).lookups == before  # refused in the client: nothing reached the daemon
    assert c.lookup(NS, [K]).present == [True]  # the client and its session are fine afterwards


def test_the_good_forms_still_work(setup: tuple[UcmClient, int]) -> None:
    """Negative control: bytes-likes, generators, numpy integers, lists of segments are accepted."""
    c, region = setup
    assert c.lookup(NS, (k for k in [K, key_digest("absent")])).present == [True, False]  # was "closed"
    assert c.lookup(bytearray(NS), [memoryview(K)]).present == [True]
    assert c.delete(NS, iter([key_digest("absent")])) == 0
    block = BlockIO(K, [Segment(region, np.int64(8192), np.uint32(4096))])  # type: ignore[arg-type]
    assert c.wait(c.load(NS, [block]), 10).ok
    task = c.dump(NS, [BlockIO(key_digest("rt-2"), (seg(region),))])
    assert c.wait(task, math.inf).ok  # an infinite wait is the daemon's longest one, not an error
    assert c.wait(np.int64(task), -5).ok  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "5"])
@pytest.mark.parametrize("name", ["rpc_timeout_s", "connect_timeout_s"])
def test_a_client_with_an_unusable_timeout_is_refused_at_once(
    daemon: DaemonProcess, name: str, bad: Any
) -> None:
    """``rpc_timeout_s=0`` (or NaN, negative) made every later call fail with DeadlineExceeded."""
    threads = threading.active_count()
    with pytest.raises(InvalidArgument, match=name):
        UcmClient(daemon.target, **{name: bad})
    assert threading.active_count() == threads  # no loop thread left behind by the refused client
    with pytest.raises(InvalidArgument, match=name):
        AsyncUcmClient(daemon.target, **{name: bad})
    with UcmClient(daemon.target, **{name: 2.0}) as ok:  # control
        assert ok.lookup(NS, [K]).present == [True]


def test_a_closed_async_client_stays_closed(daemon: DaemonProcess) -> None:
    """Every call after ``close()`` is FailedPrecondition; no new session is opened behind the caller."""

    async def scenario() -> list[str]:
        client = AsyncUcmClient(daemon.target, client_name="rt-closed")
        assert (await client.lookup(NS, [K])).present == [True]
        await client.close()
        refused = []
        for name, call in {
            "lookup": lambda: client.lookup(NS, [K]),
            "wait": lambda: client.wait(1, 1),
            "delete": lambda: client.delete(NS, [K]),
            "connect": client.connect,
        }.items():
            with pytest.raises(FailedPrecondition, match="AsyncUcmClient is closed"):
                await call()
            refused.append(name)
        await client.close()  # closing again is fine
        return refused

    assert asyncio.run(scenario()) == ["lookup", "wait", "delete", "connect"]
    names = [s.client_name for s in _stats(daemon).session_list]
    assert "rt-closed" not in names


def test_a_sync_client_closed_before_its_first_lookup_opens_no_channel(daemon: DaemonProcess) -> None:
    c = UcmClient(daemon.target, client_name="rt-closed-sync").connect()
    c.close()
    with pytest.raises(FailedPrecondition, match="UcmClient is closed"):
        c.lookup(NS, [K])
    assert c._channel is None


CONSTRUCTOR = {
    "int target": ({"target": 123}, ArgumentTypeError, "target must be a socket path or a gRPC target"),
    "int client_name": ({"client_name": 5}, ArgumentTypeError, "client_name must be a str, got int"),
    "int token": ({"token": 5}, ArgumentTypeError, "token must be a str, got int"),
    "str daemon_uid": ({"daemon_uid": "x"}, ArgumentTypeError, "daemon_uid must be an integer, got str"),
    "missing tls_ca": (
        {"tls_ca": "/nonexistent/ca.pem"},
        InvalidArgument,
        "tls_ca /nonexistent/ca.pem: cannot read",
    ),
}


def _client_loops() -> set[threading.Thread]:
    """The live loop threads of blocking clients (other tests' threads may end meanwhile, so a
    plain thread count is no measure)."""
    return {t for t in threading.enumerate() if t.name == "ucm-client-loop" and t.is_alive()}


@pytest.mark.parametrize("case", list(CONSTRUCTOR))
def test_a_bad_constructor_argument_is_named_and_leaves_no_thread(daemon: DaemonProcess, case: str) -> None:
    """Before: TypeError at connect (an int client_name), a token or uid of the wrong type accepted and
    never matching, FileNotFoundError for a TLS file, and the blocking client's loop thread left running."""
    kwargs, exc_type, message = CONSTRUCTOR[case]
    kwargs = {"target": daemon.target, **kwargs}
    loops_before = _client_loops()
    with pytest.raises(exc_type, match=message):
        UcmClient(**kwargs)  # type: ignore[arg-type]
    assert _client_loops() <= loops_before  # no loop thread of the refused client left running
    with pytest.raises(exc_type, match=message):
        AsyncUcmClient(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("size", "exc_type"), [("4096", ArgumentTypeError), (4096.0, ArgumentTypeError), (0, InvalidArgument)]
)
def test_a_shared_buffer_of_a_bad_size_is_a_typed_error(size: Any, exc_type: type[UcmError]) -> None:
    with pytest.raises(exc_type, match="SharedBuffer size must be"):
        SharedBuffer(size)
    with SharedBuffer(4096) as ok:  # control
        assert ok.size == 4096


def test_a_block_state_this_client_does_not_know_reads_as_failed_with_its_value() -> None:
    """A newer daemon may answer with a state added after this client was built: that block must
    not read as OK, and the other blocks' states must survive (no exception for the whole task)."""
    from ucm_client.types import TaskResult

    status = pb.TaskStatus(task_id=7, state=pb.TASK_DONE, block_status=[pb.BLOCK_OK, 99, pb.BLOCK_MISSING])
    result = TaskResult.from_pb(status)
    assert [s.name for s in result.states] == ["OK", "FAILED", "MISSING"]
    assert not result.ok
    assert "unknown block state 99" in result.reasons[1]
    known = TaskResult.from_pb(pb.TaskStatus(task_id=8, state=pb.TASK_DONE, block_status=[pb.BLOCK_OK]))
    assert known.ok and known.reasons == {}  # control: known states decode as before
