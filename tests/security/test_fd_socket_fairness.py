"""The fd socket is fair: no peer can keep another from handing its memory over, against a real daemon.

Three attacks that each locked every other client out of memory registration before, run by
attacker processes speaking the fd socket's wire format directly (stdlib only, forked children so
each has a pid of its own):

- *half-sent*: 20 processes keep 4 connections each open with half a request (80 in all);
- *fd flood*: 16 processes keep 4 connections each open with incomplete requests carrying 16
  descriptors each (1,024 in all: the daemon's whole descriptor limit here);
- *hoard*: 6 processes hand over memory as fast as they can and never register it, to fill the
  table of pending handovers.

Each attacker reports what the daemon did to it (connections closed, handovers answered), so a test
only counts once the attack is shown to be running against the daemon. Meanwhile a well-behaved
client registers memory, ten times, each within a second; one test per attack and one with all
three at once. The attackers run at a lower CPU priority and pause a few milliseconds between
rounds: on a 2-core machine a busy loop per attacker would measure the scheduler, not the daemon.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ucm_client import SharedBuffer, UcmClient
from ucm_protocol.fdpass import fd_socket_path
from ucm_server.peer_share import PeerShares
from ucm_server.testing.daemon import DaemonProcess

_ATTACKER = textwrap.dedent(
    """
    import fcntl, os, socket, struct, sys, time
    path, mode, children, per_child = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    os.nice(5)
    HEADER = struct.pack("!4sB3xQ", b"UCMF", 1, 4096)

    def memfd():
        fd = os.memfd_create("attacker", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4096)
        os.posix_fallocate(fd, 0, 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        return fd

    def opened():
        s = socket.socket(socket.AF_UNIX)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            return None
        try:
            if mode == "half-sent":
                s.send(HEADER[:5])
            else:  # fd-flood: descriptors with a request that never completes
                fds = [memfd() for _ in range(8)]
                socket.send_fds(s, [HEADER[:1]], fds)
                socket.send_fds(s, [HEADER[1:2]], fds)
                for fd in fds:
                    os.close(fd)
        except OSError:
            s.close()
            return None
        return s

    def report(event):
        os.write(1, (event + "\\n").encode())

    def child():
        if mode == "hoard":
            fd = memfd()
            while True:
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(5)
                try:
                    s.connect(path)
                    socket.send_fds(s, [HEADER], [fd])
                    head = s.recv(7, socket.MSG_WAITALL)
                    report("answered")  # a token, or a refusal: either way the daemon served it
                except OSError:
                    report("error")
                s.close()
                time.sleep(0.005)
        held = []
        while True:
            while len(held) < per_child:
                s = opened()
                if s is None:
                    time.sleep(0.01)
                    break
                held.append(s)
            time.sleep(0.01)
            for s in list(held):  # the daemon closing a connection shows up as EOF or a reset
                try:
                    if s.recv(4096) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                report("closed")
                held.remove(s)
                s.close()

    for _ in range(children):
        if os.fork() == 0:
            try:
                child()
            finally:
                os._exit(0)
    os.wait()
    """
)


class Attack:
    """Attacker processes of one kind, and a count of what the daemon did to them."""

    def __init__(self, d: DaemonProcess, mode: str, children: int, per_child: int = 0) -> None:
        self.events: dict[str, int] = {}
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-c",
                _ATTACKER,
                str(fd_socket_path(d.socket)),
                mode,
                str(children),
                str(per_child),
            ],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # one process group: stop() ends every child
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.events[line.strip()] = self.events.get(line.strip(), 0) + 1

    def count(self, event: str) -> int:
        with self._lock:
            return self.events.get(event, 0)

    def wait_for(self, event: str, at_least: int, timeout_s: float = 60) -> None:
        """Until the daemon has done ``event`` to this attack ``at_least`` times: the attack runs."""
        deadline = time.monotonic() + timeout_s
        while self.count(event) < at_least:
            assert self.proc.poll() is None, "the attacker died"
            assert time.monotonic() < deadline, f"the attack never got going: {self.events}"
            time.sleep(0.05)

    def stop(self) -> None:
        os.killpg(self.proc.pid, 9)
        self.proc.wait(30)


ATTACKS = {
    # mode, processes, connections each; the event that shows the daemon is processing the attack
    "half-sent": ("half-sent", 20, 4, "closed"),
    "fd-flood": ("fd-flood", 16, 4, "closed"),
    "hoard": ("hoard", 6, 0, "answered"),
}


class LowLimitDaemon(DaemonProcess):
    """The daemon with 1,024 descriptors (soft and hard), a common default it must live within."""

    def command(self) -> list[str]:
        return ["/bin/sh", "-c", 'ulimit -n 1024 && exec "$@"', "sh", *super().command()]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with LowLimitDaemon(tmp_path_factory.mktemp("fair")) as d:
        assert d.proc is not None
        limits = Path(f"/proc/{d.proc.pid}/limits").read_text()
        assert any(line.startswith("Max open files") and "1024" in line for line in limits.splitlines())
        yield d


def _open_fds(d: DaemonProcess) -> int:
    assert d.proc is not None
    return sum(1 for _ in Path(f"/proc/{d.proc.pid}/fd").iterdir())


def _registrations_take(d: DaemonProcess) -> tuple[list[float], int]:
    """Ten registrations by a well-behaved client, each timed, while attacks run; and the most
    descriptors the daemon had open meanwhile."""
    took, most_fds = [], 0
    with UcmClient(d.target, client_name="bystander") as c, SharedBuffer(1 << 20) as buf:
        for _ in range(10):
            started = time.monotonic()
            c.unregister(c.register(buf))
            took.append(time.monotonic() - started)
            most_fds = max(most_fds, _open_fds(d))
            time.sleep(0.1)
    return took, most_fds


@pytest.mark.parametrize(
    "names", [["half-sent"], ["fd-flood"], ["hoard"], ["half-sent", "fd-flood", "hoard"]]
)
def test_a_well_behaved_client_registers_within_a_second_under_attack(
    daemon: DaemonProcess, names: list[str]
) -> None:
    attacks = []
    try:
        for name in names:
            mode, children, per_child, _ = ATTACKS[name]
            attacks.append(Attack(daemon, mode, children, per_child))
        for name, attack in zip(names, attacks, strict=True):
            attack.wait_for(ATTACKS[name][3], at_least=20)  # the daemon is processing the attack
        before = {name: attack.count(ATTACKS[name][3]) for name, attack in zip(names, attacks, strict=True)}
        took, most_fds = _registrations_take(daemon)
        for name, attack in zip(names, attacks, strict=True):  # and went on processing it meanwhile
            assert attack.count(ATTACKS[name][3]) > before[name], f"{name} stopped: {attack.events}"
    finally:
        for attack in attacks:
            attack.stop()
    assert max(took) < 1.0, f"registrations under {names} took {[round(t, 2) for t in took]} s"
    # A quarter of the 1,024 descriptors stays the daemon's own, whatever the attackers send.
    assert most_fds <= 1024 - 256, f"the daemon had {most_fds} descriptors open under {names}"
    assert daemon.healthy()


def test_who_gives_way_in_a_full_table() -> None:
    """The rule on its own, with peers a single daemon test cannot make (other uids): the uid
    holding the most gives way first, then the process holding the most within it, oldest first;
    a peer holding no more than the newcomer never does."""
    shares: PeerShares[str] = PeerShares()
    for i in range(3):
        shares.add(f"root-a{i}", 0, 100)  # root, one process, 3 entries
    shares.add("root-b0", 0, 101)
    shares.add("user-c0", 1000, 200)
    shares.add("user-c1", 1000, 200)
    assert shares.victim(1000, 300) == "root-a0"  # uid 0 holds 4, uid 1000 only 2
    assert shares.victim(0, 101) == "root-a0"  # same uid: the process holding 3 gives way to one holding 1
    assert shares.victim(0, 100) is None  # the heaviest process of the heaviest uid gives way to no one
    shares.remove("root-a0")
    shares.remove("root-a1")  # uid 0: a2 (pid 100), b0 (pid 101); uid 1000: c0, c1 (pid 200)
    assert shares.victim(1000, 200) is None  # nobody holds more than this newcomer's uid and process
    assert shares.victim(1000, 300) == "user-c0"  # uids even: its own uid's heaviest process gives way
    assert shares.victim(0, 102) == "user-c0"  # likewise for a newcomer of the other uid
    assert shares.oldest_of(1000, 200) == "user-c0" and shares.oldest_of(5, 5) is None
    assert shares.of_process(0, 100) == 1 and len(shares) == 4
