"""Nothing written before a restart is lost: clean (SIGTERM) or a crash (kill -9) mid-dump."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in

from ucm_client import BlockState, SharedBuffer, UcmClient
from ucm_client.errors import UcmError
from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.slow  # each test takes seconds: not part of `make test-fast`


def test_sigterm_restart_finds_every_block(tmp_path: Path) -> None:
    n, size = 64, 64 << 10
    d = DaemonProcess(tmp_path / "ucm")
    with SharedBuffer(n * size) as src, SharedBuffer(n * size) as dst:
        src.buf[:] = os.urandom(n * size)
        with d, UcmClient(d.target) as c:
            # write-back: the dump completes in the Cache; shutdown must flush it down
            assert c.wait(c.dump(NS, blocks_in(c.register(src), n, size)), 30).ok
        assert d.proc is None  # stopped by SIGTERM in __exit__
        with d.start(), UcmClient(d.target) as c:
            blocks = blocks_in(c.register(dst), n, size)
            assert c.lookup(NS, [b.key for b in blocks]).hit_prefix == n
            assert c.wait(c.load(NS, blocks), 30).ok
            assert bytes(dst.buf) == bytes(src.buf)
            d.stop()


def test_kill_9_mid_dump_never_serves_a_torn_block(tmp_path: Path) -> None:
    """Dump continuously, kill -9 the daemon mid-way, restart: whatever Lookup reports loads intact."""
    n, size = 256, 128 << 10
    d = DaemonProcess(tmp_path / "ucm", args=["--write-mode", "write-through"])
    digests: dict[int, bytes] = {}
    with SharedBuffer(n * size) as src:
        for i in range(n):
            chunk = os.urandom(size)
            src.buf[i * size : (i + 1) * size] = chunk
            digests[i] = hashlib.sha256(chunk).digest()
        d.start()
        stop = threading.Event()
        durable: set[int] = set()

        def dump_forever() -> None:
            with UcmClient(d.target, rpc_timeout_s=5) as c:
                region = c.register(src)
                try:
                    for i in range(0, n, 8):
                        if stop.is_set():
                            return
                        r = c.wait(
                            c.dump(
                                NS, blocks_in(region, 8, size, first=i, offset=i * size), wait_durable=True
                            ),
                            10,
                        )
                        durable.update(i + j for j, s in enumerate(r.states) if s is BlockState.OK)
                except UcmError:
                    return  # the daemon died under us: expected

        t = threading.Thread(target=dump_forever)
        t.start()
        deadline = time.monotonic() + 20
        while len(durable) < n // 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        d.kill()
        stop.set()
        t.join(30)
        reported_durable = set(durable)
        assert reported_durable, "no dump completed before the kill"

    with d.start(), UcmClient(d.target) as c, SharedBuffer(n * size) as dst:
        blocks = blocks_in(c.register(dst), n, size)
        present = c.lookup(NS, [b.key for b in blocks]).present
        assert reported_durable <= {i for i, p in enumerate(present) if p}, (
            "a block reported durable was lost"
        )
        found = [b for b, p in zip(blocks, present, strict=True) if p]
        result = c.wait(c.load(NS, found), 30)
        assert result.ok, result.reasons
        for b in found:
            i = blocks.index(b)
            assert hashlib.sha256(bytes(dst.buf[i * size : (i + 1) * size])).digest() == digests[i]
        d.stop()
