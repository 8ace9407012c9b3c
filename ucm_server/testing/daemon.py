"""Run a real ``ucm-server`` process for tests and benchmarks (ours and third parties').

``DaemonProcess`` starts ``python -m ucm_server`` with a private socket and data directory, waits until
its health service answers SERVING, and stops it with SIGTERM (or kills it with SIGKILL, to test crash
recovery). Its log is kept in a file and shown when start-up fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class DaemonProcess:
    def __init__(
        self,
        workdir: Path,
        *,
        args: list[str] | None = None,
        env: Mapping[str, str] | None = None,
        socket: Path | None = None,
        data_dir: Path | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket = socket or self.workdir / "ucm.sock"
        # The daemon wants its socket directory private (0700). Only a directory of this test's own
        # (the work directory or one made here) is made so; any other is the caller's to prepare.
        sock_dir = self.socket.parent
        if not sock_dir.exists():
            sock_dir.mkdir(parents=True)
            os.chmod(sock_dir, 0o700)
        elif (
            sock_dir.resolve() == self.workdir.resolve()
            or self.workdir.resolve() in sock_dir.resolve().parents
        ):
            os.chmod(sock_dir, 0o700)
        self.data_dir = data_dir or self.workdir / "data"
        self.log_path = self.workdir / "ucm-server.log"
        self.extra_args = list(args or [])
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "ucm_server",
            "--socket",
            str(self.socket),
            "--data-dir",
            str(self.data_dir),
            "--metrics-address",
            "off",
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 30.0) -> DaemonProcess:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("this DaemonProcess is already running; stop() or kill() it first")
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
        env.update(self.env)
        log = self.log_path.open("ab")
        env["UCM_EXIT_WITH_PARENT"] = "1"  # no daemon outlives a test run, even a killed one
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ucm-server exited with {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists() and self.healthy():
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"ucm-server did not become healthy in {timeout_s}s:\n{self.log()}")

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether the daemon answers SERVING within ``timeout_s`` (generous: a loaded 2-core CI machine
        can take over a second to answer a fresh channel)."""
        try:
            with grpc.insecure_channel(self.target) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
                return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait: the clean shutdown path. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"ucm-server ignored SIGTERM for {timeout_s}s:\n{self.log()}") from None
        code = self.proc.returncode
        self.proc = None
        return code

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to clean up."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> DaemonProcess:
        """Starts the daemon unless it already runs (``with d.start(): ...`` is fine too)."""
        return self if self.proc is not None and self.proc.poll() is None else self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None:
            with contextlib.suppress(RuntimeError):
                self.stop()
