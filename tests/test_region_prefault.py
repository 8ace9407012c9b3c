"""Client regions are prefaulted after registration (``region_prefault``): the first Load into fresh
client memory costs the daemon no page fault per 4 KiB — what made a fresh vLLM process's warm TTFT
two to three times vLLM's own prefix-cache hit — and memory with holes is left
alone, so the daemon never allocates a client's memory on its behalf.

Page faults are read from the real daemon's ``/proc/<pid>/stat`` (minflt) around a real Load.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in
from support.daemon_stats import tiers_by_name

from ucm_client import SharedBuffer, UcmClient
from ucm_server.client_memory import ClientMemory, unallocated
from ucm_server.region_prefault import RegionPrefaulter
from ucm_server.testing.daemon import DaemonProcess

BLOCK = 1 << 20
COUNT = 32
PAGES = COUNT * BLOCK // 4096


def _minflt(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])  # field 10 of proc(5); fields[0] is field 3


def _wait_for_cache_prefault(c: UcmClient) -> None:
    """The Cache arena's own background prefault faults the daemon in too: on a busy host
    (a vLLM test beside this one) it ran into the window measured below, 32,789 faults with region
    prefault off. Wait until the daemon reports it done."""
    deadline = time.monotonic() + 120
    while (pending := tiers_by_name(c)["Cache"].extra["prefault_pending_bytes"]) > 0:
        assert time.monotonic() < deadline, f"the Cache arena still has {pending:.0f} bytes to fault in"
        time.sleep(0.1)


def _faults_of_first_load(tmp_path: Path, *args: str) -> tuple[int, int]:
    """(page faults while registering and settling, page faults during the first Load) of the daemon."""
    with DaemonProcess(tmp_path / "ucm", args=["--cache-capacity", "256MiB", *args]) as d:
        assert d.proc is not None
        pid = d.proc.pid
        with UcmClient(d.target) as c, SharedBuffer(COUNT * BLOCK) as src:
            src.array()[:] = 7
            r = c.register(src)
            assert c.wait(c.dump(NS, blocks_in(r, COUNT, BLOCK)), 60).ok
            _wait_for_cache_prefault(c)
            with SharedBuffer(COUNT * BLOCK) as dst:  # fresh memory the daemon never touched
                before = _minflt(pid)
                rd = c.register(dst)
                deadline = time.monotonic() + 20
                last, settled = before, 0
                while time.monotonic() < deadline and settled < 5:  # until the daemon stops faulting
                    time.sleep(0.1)
                    now = _minflt(pid)
                    settled = settled + 1 if now == last else 0
                    last = now
                start = _minflt(pid)
                assert c.wait(c.load(NS, blocks_in(rd, COUNT, BLOCK)), 60).ok
                during = _minflt(pid) - start
                assert bytes(dst.buf[:BLOCK]) == bytes(src.buf[:BLOCK])
        return start - before, during


@pytest.mark.slow
def test_the_first_load_into_fresh_client_memory_takes_no_page_fault_per_page(tmp_path: Path) -> None:
    settle_on, load_on = _faults_of_first_load(tmp_path / "on")
    settle_off, load_off = _faults_of_first_load(tmp_path / "off", "--no-region-prefault")
    # Without prefault the daemon faults once per 4 KiB page it copies into; with it, those page
    # tables were filled right after registration, in the background.
    assert load_off > PAGES // 2, (load_off, PAGES)
    assert load_on < PAGES // 8, (load_on, PAGES)
    assert settle_on > PAGES // 2, "the faults moved to registration time"
    assert settle_off < PAGES // 8


def test_memory_with_holes_is_not_prefaulted(tmp_path: Path) -> None:
    """The check that keeps the daemon from allocating a client's memory: a memfd with a hole is not
    even queued for prefault (the daemon refuses to register it at all, see tests/security)."""
    fd = os.memfd_create("ucm-test-holes")
    try:
        os.ftruncate(fd, 8 << 20)
        assert unallocated(os.fstat(fd)) == f"only 0 of {8 << 20} bytes are allocated"
        memory = ClientMemory(os.dup(fd), os.fstat(fd), pid=os.getpid(), uid=os.getuid(), session_id="t")
        view = memoryview(bytearray(4096))
        assert not RegionPrefaulter().add(view, memory, lambda: False, lambda why: None)
        memory.release()
        os.posix_fallocate(fd, 0, 8 << 20)
        assert unallocated(os.fstat(fd)) is None
    finally:
        os.close(fd)
    with SharedBuffer(4 << 20) as buf:  # what clients hand over: allocated up front
        assert unallocated(os.fstat(buf.fileno())) is None


@pytest.mark.parametrize("size", [4096, 3 << 20])
@pytest.mark.slow
def test_unregistering_while_prefaulting_is_safe(tmp_path: Path, size: int) -> None:
    with DaemonProcess(tmp_path / "ucm") as d, UcmClient(d.target) as c:
        for _ in range(20):
            with SharedBuffer(size) as buf:
                c.unregister(c.register(buf))
        with SharedBuffer(size) as buf:
            r = c.register(buf)
            assert c.wait(c.dump(NS, blocks_in(r, 1, 4096)), 30).ok
        assert d.healthy()
