"""Red team: clients racing on the same keys (loads, dumps, deletes, evictions at once).

Found: a Load reading a block from the Posix tier while another client deleted (or evicted) that
block failed every unfinished block of the load with "internal error: BlockKey(...)" and logged a
traceback: the read finished in its worker thread, then marking the key recently used raised KeyError
because the delete had removed it meanwhile (``BlockIndex.move_to_end``). Four clients hit it dozens of
times in eight seconds. Now the read stands (its bytes were whole and checked); every loaded block is
OK with the bytes some client dumped, or MISSING.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from support.blocks import NS

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.slow  # each test takes seconds: not part of `make test-fast`

SIZE = 16 << 10
KEYS = [key_digest("rt-race", i) for i in range(16)]
WRITERS = 3
RUN_S = 3.0


def content(key: bytes, writer: int) -> bytes:
    return (key[:7] + bytes([writer])) * (SIZE // 8)


@pytest.fixture
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A small Cache over Posix: most loads read block files, where the race was."""
    with DaemonProcess(tmp_path_factory.mktemp("rt-race") / "ucm", args=["--cache-capacity", "1MiB"]) as d:
        yield d


def _worker(d: DaemonProcess, me: int, stop: float, problems: list[str]) -> None:
    rnd = random.Random(me)
    with (
        UcmClient(d.target, client_name=f"race-{me}") as c,
        SharedBuffer(8 * SIZE) as buf,
        grpc.insecure_channel(d.target) as ch,
    ):
        region, admin = c.register(buf), rpc.AdminStub(ch)
        while time.monotonic() < stop:
            picked = rnd.sample(range(len(KEYS)), 4)
            op = rnd.choice(["dump", "load", "load", "delete", "evict"])
            if op == "dump":
                for j, i in enumerate(picked):
                    buf.buf[j * SIZE : (j + 1) * SIZE] = content(KEYS[i], me)
                blocks = [BlockIO(KEYS[i], (Segment(region, j * SIZE, SIZE),)) for j, i in enumerate(picked)]
                result = c.wait(c.dump(NS, blocks), 20)
                if not result.ok:
                    problems.append(f"dump: {result.reasons}")
            elif op == "load":
                buf.buf[4 * SIZE :] = b"\xee" * (4 * SIZE)
                blocks = [
                    BlockIO(KEYS[i], (Segment(region, (4 + j) * SIZE, SIZE),)) for j, i in enumerate(picked)
                ]
                result = c.wait(c.load(NS, blocks), 20)
                for j, i in enumerate(picked):
                    got = bytes(buf.buf[(4 + j) * SIZE : (5 + j) * SIZE])
                    state = result.states[j]
                    if state is BlockState.OK and got not in {content(KEYS[i], w) for w in range(WRITERS)}:
                        problems.append(f"load: wrong bytes for key {i}")
                    elif state not in (BlockState.OK, BlockState.MISSING):
                        problems.append(f"load: {state.name}: {result.reasons.get(j)}")
            elif op == "delete":
                c.delete(NS, [KEYS[i] for i in picked[:2]])
            else:
                tier = rnd.choice(["Cache", "Posix"])
                admin.Evict(
                    pb.EvictRequest(tier=tier, namespace=NS, keys=[KEYS[i] for i in picked[:2]]), timeout=10
                )


def test_loads_racing_deletes_and_evictions_never_fail_nor_serve_wrong_bytes(daemon: DaemonProcess) -> None:
    problems: list[str] = []
    stop = time.monotonic() + RUN_S
    threads = [threading.Thread(target=_worker, args=(daemon, me, stop, problems)) for me in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert problems == [], problems[:5]
    assert daemon.healthy()
    assert not re.search(r"task \d+ failed|Traceback", daemon.log()), daemon.log()[-3000:]
