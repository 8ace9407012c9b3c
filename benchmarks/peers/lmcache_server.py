"""The ``lmcache server`` process the LMCache peer benchmark (``lmcache_peer.py``) measures.

Started on free loopback ports in its own process group, told to die with the benchmark (even a
SIGKILLed one), always stopped by it; plus the signal handling and the shared-memory sweep that keep a
killed or interrupted run from leaving a server or RAM-backed segments behind. Runs in LMCache's venv
next to ``lmcache_peer.py``, and imports nothing of LMCache (it starts the server as a command).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

PR_SET_PDEATHSIG = 1


def log(msg: str) -> None:
    """Diagnostics go to stderr so stdout stays one parseable JSON object."""
    print(f"lmcache_peer: {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    """Ask the kernel for a free loopback port (a small race, fine for a benchmark)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """preexec_fn: the server gets SIGTERM if this script dies, even by SIGKILL (Linux only)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class LMCacheServer:
    """One ``lmcache server`` process: started in its own process group, always stopped by us.

    Its output goes to a temporary log file (it is chatty), whose tail we print when it fails.
    """

    def __init__(self, l1_size_gb: float, port: int, http_port: int) -> None:
        self.port = port
        self.http_port = http_port
        self.l1_size_gb = l1_size_gb
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115  (closed in stop())
            prefix="lmcache-server-", suffix=".log", delete=False
        )
        self.log_path = Path(self._log_file.name)

    def _command(self) -> list[str]:
        exe = Path(sys.executable).parent / "lmcache"
        base = [str(exe)] if exe.exists() else [sys.executable, "-m", "lmcache.cli.main"]
        return [
            *base,
            "server",
            "--l1-size-gb",
            f"{self.l1_size_gb:g}",
            "--eviction-policy",
            "LRU",
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
        ]

    def start(self) -> None:
        cmd = self._command()
        # The server logs at INFO into its own file, whose tail is what explains a failed start.
        env = dict(os.environ, LMCACHE_TRACK_USAGE="false", LMCACHE_LOG_LEVEL="INFO")
        log(f"starting: {' '.join(cmd)} (log: {self.log_path})")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509  (only calls prctl; runs before any lmcache thread starts)
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no server log)"

    def stop(self) -> None:
        """SIGTERM the server's process group, then SIGKILL it if it lingers; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    log(f"server pid {proc.pid} still running after {sig.name}")
            log(f"server stopped (exit {proc.returncode})")
        elif proc is not None:
            log(f"server had already exited ({proc.returncode}); log tail:\n{self.log_tail()}")
        if not self._log_file.closed:
            self._log_file.close()
            if os.environ.get("LMCACHE_PEER_KEEP_LOG") != "1":
                self.log_path.unlink(missing_ok=True)


@contextlib.contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM (what a timed-out runner sends) and SIGINT into KeyboardInterrupt.

    SIGINT is set explicitly because a shell starts background jobs with SIGINT ignored, and a
    benchmark that ignores Ctrl-C would leave its server behind.
    """

    def handler(signum: int, frame: types.FrameType | None) -> None:
        # One interrupt is enough: a second one (Ctrl-C reaches a runner and this script, and the
        # runner then sends SIGTERM) must not cut short the ``finally`` that stops the server.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def sweep_stale_shm(shm_dir: Path = Path("/dev/shm")) -> None:
    """Unlink LMCache KV segments left by a client that died without cleaning up (e.g. SIGKILL).

    LMCache names them ``lmcache_kv_<pid>_<n>`` and unlinks them on a clean close; a killed run
    leaves up to chunks x chunk-bytes of RAM-backed tmpfs behind. Only segments of this user whose
    creating process no longer exists are removed.
    """
    for path in shm_dir.glob("lmcache_kv_*_*"):
        try:
            pid = int(path.name.split("_")[2])
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                path.unlink()
                log(f"removed stale shared-memory segment {path} (pid {pid} is gone)")
        except (ValueError, IndexError, OSError):
            continue
