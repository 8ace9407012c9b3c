"""Issue #11, section 10: the socket is the daemon's, and the client checks that.

The daemon (a real ``ucm-server`` process) refuses to start in a socket directory another user owns
or may write to, naming the path and the fix, and never deletes a file that ``--socket`` names by
mistake; only a stale socket is cleared. The client, before sending its bearer token or any memory,
checks the socket's directory and the uid of the process listening (``SO_PEERCRED``): a fake daemon
run as ``nobody`` (a real process that drops to uid 65534) is refused with ``PermissionDenied`` and
receives not one byte, and no descriptor.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in

from ucm_client import SharedBuffer, UcmClient
from ucm_client.errors import PermissionDenied, Unavailable
from ucm_client.handover import hand_over
from ucm_client.trust import trusted_uids
from ucm_protocol.fdpass import fd_socket_path
from ucm_server.testing.daemon import DaemonProcess

NOBODY = 65534


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _run_daemon(
    socket_path: Path, data_dir: Path, *, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Start ucm-server expecting it to refuse (it is killed if it starts after all)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    cmd = [sys.executable, "-m", "ucm_server", "--socket", str(socket_path), "--data-dir", str(data_dir)]
    cmd += ["--metrics-address", "off"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**base, **(env or {})})


def _refused(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o750, 0o1777])
def test_daemon_refuses_a_socket_directory_others_can_use(tmp_path: Path, mode: int) -> None:
    sock_dir = tmp_path / "run"
    sock_dir.mkdir()
    os.chmod(sock_dir, mode)
    proc = _run_daemon(sock_dir / "ucm.sock", tmp_path / "data")
    _refused(proc, str(sock_dir), f"mode {mode:04o}", f"chmod 700 {sock_dir}")
    assert not (sock_dir / "ucm.sock").exists()
    assert stat.S_IMODE(sock_dir.stat().st_mode) == mode, "the daemon must not quietly change the directory"


def test_daemon_refuses_a_socket_directory_of_another_uid(tmp_path: Path) -> None:
    sock_dir = _private_dir(tmp_path / "run")
    os.chown(sock_dir, NOBODY, NOBODY)
    proc = _run_daemon(sock_dir / "ucm.sock", tmp_path / "data")
    _refused(proc, str(sock_dir), f"owner uid {NOBODY}", "chown")
    assert not (sock_dir / "ucm.sock").exists()


@pytest.mark.parametrize("kind", ["regular file", "symlink", "directory", "fifo"])
def test_socket_path_naming_something_else_is_never_deleted(tmp_path: Path, kind: str) -> None:
    sock_dir = _private_dir(tmp_path / "run")
    target = sock_dir / "ucm.sock"
    precious = tmp_path / "precious.txt"
    precious.write_text("do not delete me")
    if kind == "regular file":
        target.write_text("do not delete me")
    elif kind == "symlink":
        target.symlink_to(precious)
    elif kind == "directory":
        target.mkdir()
    else:
        os.mkfifo(target)
    proc = _run_daemon(target, tmp_path / "data")
    _refused(proc, str(target), "not a socket", "refusing to remove it")
    assert target.exists() or target.is_symlink()
    assert precious.read_text() == "do not delete me"
    if kind == "regular file":
        assert target.read_text() == "do not delete me"


def test_fd_socket_path_naming_a_file_is_never_deleted(tmp_path: Path) -> None:
    sock_dir = _private_dir(tmp_path / "run")
    fds = fd_socket_path(sock_dir / "ucm.sock")
    fds.write_text("mine")
    _refused(_run_daemon(sock_dir / "ucm.sock", tmp_path / "data"), str(fds), "not a socket")
    assert fds.read_text() == "mine"


def _stale_socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the file stays, nobody listens: what a crash leaves


def test_stale_sockets_are_cleared_and_a_missing_directory_is_made_private(tmp_path: Path) -> None:
    sock_dir = _private_dir(tmp_path / "run")
    _stale_socket(sock_dir / "ucm.sock")
    _stale_socket(fd_socket_path(sock_dir / "ucm.sock"))
    with DaemonProcess(tmp_path / "a", socket=sock_dir / "ucm.sock") as d:
        _round_trip(d)
        # A live daemon is not displaced by a second one.
        _refused(_run_daemon(sock_dir / "ucm.sock", tmp_path / "data2"), "already listening")
        assert d.healthy()
    assert not (sock_dir / "ucm.sock").exists() and not fd_socket_path(sock_dir / "ucm.sock").exists()
    # A directory that does not exist is created 0700 whatever the umask (its parents normally).
    deep = tmp_path / "new" / "parents" / "run"
    script = "import os, runpy; os.umask(0); runpy.run_module('ucm_server', run_name='__main__')"
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")} | {"UCM_EXIT_WITH_PARENT": "1"}
    cmd = [
        sys.executable,
        "-c",
        script,
        "--socket",
        str(deep / "ucm.sock"),
        "--data-dir",
        str(tmp_path / "d3"),
    ]
    proc = subprocess.Popen(
        [*cmd, "--metrics-address", "off"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        _wait_for(deep / "ucm.sock", proc)
        assert stat.S_IMODE(deep.stat().st_mode) == 0o700
        assert stat.S_IMODE((deep / "ucm.sock").stat().st_mode) == 0o600
        assert stat.S_IMODE(fd_socket_path(deep / "ucm.sock").stat().st_mode) == 0o600
    finally:
        proc.terminate()
        proc.wait(30)


def test_default_socket_directory_works_with_no_arguments(tmp_path: Path) -> None:
    """`ucm-server` with no arguments: $XDG_RUNTIME_DIR/ucm is created 0700 and clients find it."""
    runtime = _private_dir(tmp_path / "xdg-runtime")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCM_", "XDG_"))}
    env |= {
        "XDG_RUNTIME_DIR": str(runtime),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "UCM_METRICS_ADDRESS": "off",
        "UCM_EXIT_WITH_PARENT": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "ucm_server"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    sock = runtime / "ucm" / "ucm.sock"
    try:
        _wait_for(sock, proc)
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        with UcmClient(sock) as c, SharedBuffer(4096) as buf:
            assert c.wait(c.dump(NS, blocks_in(c.register(buf), 1, 4096)), 10).ok
    finally:
        proc.terminate()
        proc.wait(30)


def _wait_for(sock: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while not (sock.exists() and fd_socket_path(sock).exists()):
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"the daemon did not start: {out}")
        time.sleep(0.05)
    time.sleep(0.2)


def _round_trip(d: DaemonProcess) -> None:
    with UcmClient(d.target) as c, SharedBuffer(2 * 4096) as src, SharedBuffer(2 * 4096) as dst:
        src.buf[:] = os.urandom(src.size)
        assert c.wait(c.dump(NS, blocks_in(c.register(src), 2, 4096)), 10).ok
        assert c.wait(c.load(NS, blocks_in(c.register(dst), 2, 4096)), 10).ok
        assert bytes(dst.buf) == bytes(src.buf)


# -- the client checks who serves the socket ------------------------------------------------------

_FAKE_DAEMON = textwrap.dedent(
    """
    import array, os, socket, sys
    path, log_path, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    log = open(log_path, "a", buffering=1)
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)  # as root, in a directory root owns; then become `uid` before listening
    os.chmod(path, 0o666)
    if uid:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    s.listen(16)
    print("READY", flush=True)
    while True:
        conn, _ = s.accept()
        conn.settimeout(1.0)
        got, fds = b"", 0
        try:
            while True:
                data, anc, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(64))
                for level, kind, raw in anc:
                    if kind == socket.SCM_RIGHTS:
                        fds += len(raw) // 4
                if not data:
                    break
                got += data
        except OSError:
            pass
        log.write(f"{len(got)} {fds} {got.hex()}\\n")
        conn.close()
    """
)


class FakeDaemon:
    """A listener that records what each connection sent; it runs as ``uid`` (SO_PEERCRED says so)."""

    def __init__(self, path: Path, uid: int, log: Path) -> None:
        self.path, self.log = path, log
        log.touch()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _FAKE_DAEMON, str(path), str(log), str(uid)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "READY"

    def connections(self) -> list[tuple[int, int, bytes]]:
        """Every connection the fake served before this call. A marker connection goes last and is
        waited for: the fake serves connections in order, so once the marker is in the log every
        earlier connection is too (a fixed sleep let "nothing was received" pass on a slow machine
        before the fake had read anything)."""
        marker = b"MARKER-" + os.urandom(8).hex().encode()
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.path))
            s.sendall(marker)
        deadline = time.monotonic() + 60
        while True:
            out = []
            for line in self.log.read_text().splitlines():
                n, fds, hexed = [*line.split(), ""][:3]
                out.append((int(n), int(fds), bytes.fromhex(hexed)))
            if out and out[-1][2] == marker:
                return out[:-1]
            assert time.monotonic() < deadline, f"the fake daemon never logged the marker: {out}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def fake_nobody(tmp_path: Path) -> Iterator[FakeDaemon]:
    """A fake daemon run as nobody, on a socket in a directory root owns (0700): only SO_PEERCRED
    tells the client who it is."""
    sock_dir = _private_dir(tmp_path / "fake")
    fake = FakeDaemon(sock_dir / "ucm.sock", NOBODY, tmp_path / "fake.log")
    yield fake
    fake.stop()


def test_client_refuses_a_daemon_of_another_uid_and_sends_nothing(fake_nobody: FakeDaemon) -> None:
    c = UcmClient(fake_nobody.path, token="SECRET-BEARER-TOKEN", connect_timeout_s=2)
    try:
        with pytest.raises(PermissionDenied) as info:
            c.connect()
        text = str(info.value)
        assert str(fake_nobody.path) in text and f"uid {NOBODY}" in text and "expected uid 0" in text
        with pytest.raises(PermissionDenied):  # the blocking lookup channel checks too
            c.lookup(NS, [b"\0" * 32])
        with SharedBuffer(4096) as buf, pytest.raises(PermissionDenied):
            c.register(buf)
    finally:
        c.close()
    conns = fake_nobody.connections()
    assert conns, "the client did not even probe the socket"
    assert all(n == 0 and fds == 0 for n, fds, _ in conns), f"the fake daemon received {conns}"


def test_client_hands_no_memory_to_an_fd_socket_of_another_uid(tmp_path: Path) -> None:
    sock_dir = _private_dir(tmp_path / "fake")
    grpc_path = sock_dir / "ucm.sock"
    fake = FakeDaemon(fd_socket_path(grpc_path), NOBODY, tmp_path / "fds.log")
    try:
        with SharedBuffer(4096) as buf, pytest.raises(PermissionDenied, match=f"uid {NOBODY}"):
            hand_over(grpc_path, buf.fileno(), 4096, trusted_uids())
        conns = fake.connections()
        assert conns and all(n == 0 and fds == 0 for n, fds, _ in conns), conns
    finally:
        fake.stop()


@pytest.mark.parametrize("problem", ["owner", "mode"])
def test_client_refuses_a_socket_in_a_directory_others_control(tmp_path: Path, problem: str) -> None:
    """The directory counts too: whoever can write there could swap the socket after the check."""
    sock_dir = _private_dir(tmp_path / "fake")
    fake = FakeDaemon(sock_dir / "ucm.sock", 0, tmp_path / "fake.log")  # served by root: peer check passes
    try:
        if problem == "owner":
            os.chown(sock_dir, NOBODY, NOBODY)
            want = f"its directory belongs to uid {NOBODY}"
        else:
            os.chmod(sock_dir, 0o777)
            want = "mode 0777"
        c = UcmClient(fake.path, token="SECRET", connect_timeout_s=2)
        try:
            with pytest.raises(PermissionDenied, match=want):
                c.connect()
        finally:
            c.close()
        assert fake.connections() == [], "the client connected through a directory another user controls"
    finally:
        fake.stop()


@pytest.mark.parametrize("how", ["option", "environment"])
def test_a_configured_daemon_uid_is_trusted(
    fake_nobody: FakeDaemon, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """With daemon_uid (or $UCM_DAEMON_UID) = nobody, the same fake passes the check: the client goes
    on to speak gRPC to it (and then finds it is no daemon), which shows the uid was what stopped it."""
    if how == "environment":
        monkeypatch.setenv("UCM_DAEMON_UID", str(NOBODY))
        c = UcmClient(fake_nobody.path, connect_timeout_s=1)
    else:
        c = UcmClient(fake_nobody.path, connect_timeout_s=1, daemon_uid=NOBODY)
    try:
        with pytest.raises(Unavailable):
            c.connect()
    finally:
        c.close()
    assert any(n > 0 for n, _, _ in fake_nobody.connections()), "the client never spoke to the trusted daemon"


def test_admin_tool_refuses_a_daemon_of_another_uid(fake_nobody: FakeDaemon) -> None:
    env = {**os.environ, "UCM_TOKEN": "ADMIN-SECRET"}
    cmd = [
        sys.executable,
        "-m",
        "ucm_client.admin",
        "--socket",
        str(fake_nobody.path),
        "--timeout",
        "2",
        "stats",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0 and f"uid {NOBODY}" in proc.stderr, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert all(n == 0 for n, _, _ in fake_nobody.connections()), "ucm-admin sent bytes to the fake daemon"
