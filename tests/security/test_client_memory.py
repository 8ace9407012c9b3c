"""Issue #11, section 1: nothing a client does to its own memory can crash or hang the daemon.

Client memory is a memfd sealed against shrinking and growing, with every page allocated by the
client, handed to the daemon by file descriptor. These tests attack it as a hostile or buggy client
would, against a real ``ucm-server`` process: shrink it (``ftruncate``, reopen with ``O_TRUNC``), punch
holes in it, drop it (close the fd and the mapping), re-create it, or exit, each while it is
registered and idle, while a dump reads from it and while a load writes into it. After each the
daemon must be alive, the task must end with per-block results (never ``INTERNAL``), and a normal
round trip must still return the right bytes. Before the fix, a ``ftruncate`` here killed the daemon
with ``SIGBUS``. They also check that nothing is left under ``/dev/shm`` and that a refused
allocation is a clear error, not a later ``SIGBUS``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.blocks import NS
from support.slow_tier import slow_daemon

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest
from ucm_client.errors import FailedPrecondition, InvalidArgument
from ucm_server.testing.daemon import DaemonProcess

SIZE = 64 << 10
N = 64  # blocks per task: ~0.4 s behind the slow tier (8 io threads), long enough to act in the middle
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def _dev_shm(pid: int) -> list[str]:
    """What process ``pid`` has under /dev/shm. Other tests on the machine may add their own objects,
    so only names carrying the pid as a whole token count (the old SharedBuffer named them
    ucm-<pid>-...). A bare substring test is not enough: vLLM's own objects carry a hex uuid, and
    ``vllm_dist_db6b...c857717e...`` once "belonged" to pid 8577."""
    token = re.compile(rf"(?<![0-9A-Za-z]){pid}(?![0-9A-Za-z])")
    return [p.name for p in Path("/dev/shm").iterdir() if token.search(p.name)]


def _content(tag: str, i: int) -> bytes:
    return (f"{tag}:{i}:".encode() * (SIZE // 8 + 1))[:SIZE]


def _blocks(region: int, tag: str, n: int = N) -> list[BlockIO]:
    return [BlockIO(key_digest(tag, i), (Segment(region, i * SIZE, SIZE),)) for i in range(n)]


def _fill(buf: SharedBuffer, tag: str, n: int = N) -> None:
    for i in range(n):
        buf.buf[i * SIZE : (i + 1) * SIZE] = _content(tag, i)


def _round_trip_works(d: DaemonProcess, tag: str) -> None:
    """A fresh client stores and loads blocks and gets every byte back: the daemon is healthy."""
    assert d.healthy(), d.log()
    with (
        UcmClient(d.target, client_name="after") as c,
        SharedBuffer(4 * SIZE) as src,
        SharedBuffer(4 * SIZE) as dst,
    ):
        _fill(src, tag, 4)
        assert c.wait(c.dump(NS, _blocks(c.register(src), tag, 4)), 30).ok
        assert c.wait(c.load(NS, _blocks(c.register(dst), tag, 4)), 30).ok
        assert bytes(dst.buf) == bytes(src.buf)


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon whose only tier sleeps 10 ms per block read and written: tasks take long enough to be
    attacked while they run."""
    with slow_daemon(tmp_path_factory.mktemp("clientmem"), 0.05) as d:
        yield d


def test_shared_buffer_is_a_sealed_preallocated_memfd_and_leaves_nothing_in_dev_shm() -> None:
    meminfo = _shmem_kib()
    buf = SharedBuffer(8 << 20, label="kv")
    fd = buf.fileno()
    assert str(Path(f"/proc/self/fd/{fd}").readlink()).startswith("/memfd:ucm-")
    assert _dev_shm(os.getpid()) == [], "a SharedBuffer must not create anything under /dev/shm"
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
    # Every page is allocated by the client at creation (billed to its cgroup, not the daemon's).
    assert os.fstat(fd).st_blocks * 512 >= 8 << 20
    assert _shmem_kib() - meminfo >= (8 << 20) // 1024 - 1024  # other processes may free some meanwhile
    assert not any(buf.buf[::4096]), "a new buffer reads as zeros, as torch.zeros promises"
    for bad_size in (0, 4096, 16 << 20):  # shrinking and growing are both refused by the seals
        with pytest.raises(PermissionError):
            os.ftruncate(fd, bad_size)
    with pytest.raises(PermissionError):  # and so is reopening it with O_TRUNC, or truncating by path
        os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_TRUNC)
    with pytest.raises(PermissionError):
        os.truncate(buf.path, 0)
    with pytest.raises(PermissionError):  # the seals themselves are sealed
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    buf.close()
    assert buf.fileno() == -1
    assert _dev_shm(os.getpid()) == []


def _shmem_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    raise AssertionError("no Shmem line in /proc/meminfo")


def test_a_refused_allocation_is_a_clear_error_not_a_sigbus() -> None:
    """The allocation is refused for real here by a file-size limit (RLIMIT_FSIZE) in a child process;
    in a container it is the memory cgroup. Either way the client gets SharedMemoryError (a MemoryError
    and a UcmError) naming the size and what to raise, at creation, instead of dying later."""
    script = textwrap.dedent(
        """
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        from ucm_client import SharedBuffer, SharedMemoryError
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        try:
            SharedBuffer(64 << 20, label="kv cache")
        except SharedMemoryError as exc:
            assert isinstance(exc, MemoryError)
            print("REFUSED", exc)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED could not allocate 67108864 bytes" in proc.stdout
    assert "kv cache" in proc.stdout and "memory limit" in proc.stdout


def test_client_process_leaves_nothing_in_dev_shm(slow: DaemonProcess) -> None:
    """A client that registers memory and exits (cleanly, or by SIGKILL) leaves no /dev/shm object."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from ucm_client import SharedBuffer, UcmClient
        c = UcmClient({slow.target!r})
        buf = SharedBuffer(1 << 20)
        c.register(buf)
        print(os.getpid(), flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        c.close()
        """
    )
    for how in ("exit", "kill"):
        proc = subprocess.run(
            [sys.executable, "-c", script, how],
            capture_output=True,
            text=True,
            timeout=60,
            check=how == "exit",
        )
        pid = int(proc.stdout.split()[0])
        assert _dev_shm(pid) == [], f"client pid {pid} ({how}) left objects in /dev/shm"
    _round_trip_works(slow, "after-exit")


def _punch_holes(fd: int, size: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _attack(buf: SharedBuffer, action: str) -> SharedBuffer | None:
    """Do ``action`` to the client's own memory; return a re-created buffer where there is one."""
    fd = buf.fileno()
    if action == "truncate":
        for size in (0, SIZE, buf.size * 2):
            with pytest.raises(OSError) as info:
                os.ftruncate(fd, size)
            assert info.value.errno == errno.EPERM
        with pytest.raises(PermissionError):
            os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_TRUNC)
        return None
    if action == "punch":  # allowed by the seals; the daemon then refuses the memory, never faults
        _punch_holes(fd, buf.size)
        return None
    buf.close()  # "unlink": the client drops its descriptor and its mapping
    if action == "recreate":
        fresh = SharedBuffer(buf.size)
        _fill(fresh, "recreated")
        return fresh
    return None


ACTIONS = ["truncate", "punch", "close", "recreate"]


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("state", ["registered", "mid-dump", "mid-load"])
def test_client_memory_attacked_in_every_state(slow: DaemonProcess, state: str, action: str) -> None:
    tag = f"{state}-{action}"
    with UcmClient(slow.target, client_name=tag) as c:
        buf = SharedBuffer(N * SIZE, label=tag)
        _fill(buf, tag)
        region = c.register(buf)
        if state == "mid-load":  # the blocks exist in the tier; the load writes into the memory
            assert c.wait(c.dump(NS, _blocks(region, tag)), 60).ok
        task = None
        if state == "mid-dump":
            task = c.dump(NS, _blocks(region, tag))
        elif state == "mid-load":
            task = c.load(NS, _blocks(region, tag))
        if task is not None:
            time.sleep(0.1)
            assert not c.check(task).done, "the task ended before the attack: make the tier slower"
        fresh = _attack(buf, action)
        if task is not None:
            result = c.wait(task, 60)
            assert result.done, "the task never finished"
            for i, state_ in enumerate(result.states):
                assert state_ in (BlockState.OK, BlockState.FAILED), (i, state_, result.reasons.get(i))
        assert slow.healthy(), f"the daemon died after {action} {state}:\n{slow.log()}"
        if state == "registered" and action == "punch":  # memory with holes: refused and dropped
            with pytest.raises((FailedPrecondition, InvalidArgument), match=r"has holes|unknown region"):
                c.dump(NS, _blocks(region, tag + "-again"))
        elif state == "registered":  # the region stays usable: a dump from it completes block by block
            result = c.wait(c.dump(NS, _blocks(region, tag + "-again")), 60)
            assert result.done and len(result.states) == N
        if state == "mid-dump" and action == "truncate":  # nothing changed: every byte was stored
            with SharedBuffer(N * SIZE) as out:
                assert c.wait(c.load(NS, _blocks(c.register(out), tag)), 60).ok
                assert all(bytes(out.buf[i * SIZE : (i + 1) * SIZE]) == _content(tag, i) for i in range(N))
        if fresh is not None:  # the re-created memory registers and works like any other
            with fresh:
                fresh_region = c.register(fresh)
                assert c.wait(c.dump(NS, _blocks(fresh_region, tag + "-fresh")), 60).ok
        if buf.fileno() >= 0:
            buf.close()
    _round_trip_works(slow, tag)


@pytest.mark.parametrize("state", ["mid-dump", "mid-load"])
def test_client_exits_mid_task(slow: DaemonProcess, state: str) -> None:
    """The client process closes its memory and exits while its task runs: the daemon reaps the
    session and keeps serving."""
    tag = f"exit-{state}"
    if state == "mid-load":
        with UcmClient(slow.target) as c, SharedBuffer(N * SIZE) as buf:
            _fill(buf, tag)
            assert c.wait(c.dump(NS, _blocks(c.register(buf), tag)), 60).ok
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest
        from support.blocks import NS
        c = UcmClient({slow.target!r})
        buf = SharedBuffer({N * SIZE})
        region = c.register(buf)
        blocks = [BlockIO(key_digest({tag!r}, i), (Segment(region, i * {SIZE}, {SIZE}),)) for i in range({N})]
        task = c.dump(NS, blocks) if {state!r} == "mid-dump" else c.load(NS, blocks)
        time.sleep(0.1)
        print("STARTED", flush=True)
        buf.close()
        os._exit(0)
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert "STARTED" in proc.stdout, proc.stderr
    _round_trip_works(slow, tag + "-after")


def test_the_vllm_kv_memory_is_allocated_in_full_before_it_is_handed_over() -> None:
    """Both ways the vLLM connector puts its KV cache in shared memory, the allocation answered from
    a SharedBuffer and an existing cache moved into one, give the daemon memory with no holes (the
    daemon refuses any other)."""
    torch = pytest.importorskip("torch", reason="the vLLM KV memory is torch tensors")
    from ucm_client.vllm.kv_memory import ShmAllocation, adopt

    with ShmAllocation() as mode:
        torch.zeros(8 << 20, dtype=torch.int8, device="cpu")
    assert mode.buffer is not None
    moved, _ = adopt({"layer.0": torch.ones(4 << 20, dtype=torch.int8)}, [])
    for buf in (mode.buffer, moved):
        st = os.fstat(buf.fileno())
        assert st.st_blocks * 512 >= st.st_size == buf.size, (st.st_blocks, st.st_size)
