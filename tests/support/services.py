"""Real storage servers on loopback for tests and benchmarks: Mooncake Store's master and Ceph RGW.

Tests of the shared tiers talk to the real engines, never to mocks, so these helpers start them on
127.0.0.1 with free ports under a caller-owned temporary directory and stop them again. Each handle can
``kill()`` its server (the state a restart needs is kept) and ``restart()`` it on the same address, so
fault-injection tests can take a server away under a live tier and give it back.

A server that is not installed raises :class:`ServiceUnavailable` with the install command in the
message; test fixtures turn that into ``pytest.skip(reason)``. Install with
``scripts/services/install_mooncake.sh`` and ``scripts/services/install_ceph.sh``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

LOOPBACK = "127.0.0.1"


class ServiceUnavailable(RuntimeError):
    """The server cannot be started here (not installed, or it did not come up); the message says why."""


def free_port() -> int:
    """A TCP port free on loopback right now (the usual bind-to-0 trick; racy only against strangers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def _wait_until(what: str, check: Callable[[], bool], timeout_s: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    tail = ""
    if log is not None and log.exists():
        tail = "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    raise ServiceUnavailable(f"{what} did not come up within {timeout_s:.0f}s{tail}")


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((LOOPBACK, port)) == 0


def _stop_process(proc: subprocess.Popen[bytes] | None, grace_s: float = 5.0) -> None:
    """SIGTERM then SIGKILL the one process we started (its own process group, so helpers die too)."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGCONT)  # a paused server would never act on SIGTERM
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(grace_s)


def _spawn(argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )


# -- Mooncake Store master -------------------------------------------------------------------------------


def mooncake_master_binary() -> Path:
    """The real ``mooncake_master`` executable shipped inside the wheel (the console script of the same
    name is a Python wrapper whose pid is not the server's, so stopping it would orphan the master)."""
    try:
        import mooncake
    except ImportError as exc:
        raise ServiceUnavailable(
            f"Mooncake is not installed ({exc}); run scripts/services/install_mooncake.sh"
        ) from exc
    binary = Path(mooncake.__file__).parent / "mooncake_master"
    if not binary.exists():
        raise ServiceUnavailable(f"{binary} missing from the mooncake wheel")
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401 - checks shared libs load
    except ImportError as exc:
        raise ServiceUnavailable(
            f"mooncake.store does not load ({exc}); run scripts/services/install_mooncake.sh"
        ) from exc
    return binary


@dataclass
class MooncakeMaster:
    """A running ``mooncake_master``: ``address`` is its RPC ``host:port``, ``http`` its admin/metrics
    URL (``/get_all_keys``, ``/health``). The master keeps metadata in memory, so a restart forgets
    every object (their bytes lived in the clients' segments) but clients reconnect by themselves."""

    address: str
    http: str
    workdir: Path
    rpc_port: int
    http_port: int
    started_in_s: float = 0.0
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def _start(self) -> None:
        argv = [
            str(mooncake_master_binary()),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={self.rpc_port}",
            "--rpc_thread_num=2",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.http_port}",
            f"--log_dir={self.workdir}",
        ]
        t0 = time.monotonic()
        log = self.workdir / "master.log"
        self._proc = _spawn(argv, log)
        _wait_until(
            "mooncake_master", lambda: _port_open(self.rpc_port) and _port_open(self.http_port), 15.0, log
        )
        self.started_in_s = time.monotonic() - t0

    def kill(self) -> None:
        """Stop the master abruptly (SIGKILL), as a crash would."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(5)

    def pause(self) -> None:
        """Freeze the master (SIGSTOP): connections stay open and nothing answers, like a hung server."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Start the master again on the same ports (after :meth:`kill` or :meth:`stop`)."""
        self.stop()
        self._start()

    def stop(self) -> None:
        _stop_process(self._proc)


def start_mooncake_master(tmpdir: Path | str) -> MooncakeMaster:
    """Start a Mooncake master on free loopback ports; the caller must ``stop()`` it."""
    workdir = Path(tmpdir) / f"mooncake-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    rpc, http = free_port(), free_port()
    master = MooncakeMaster(
        address=f"{LOOPBACK}:{rpc}",
        http=f"http://{LOOPBACK}:{http}",
        workdir=workdir,
        rpc_port=rpc,
        http_port=http,
    )
    try:
        master._start()
    except BaseException:
        master.stop()
        raise
    return master


# -- Ceph: one mon + one memstore OSD + RGW ---------------------------------------------------------------

_CEPH_BINARIES = ("monmaptool", "ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph")


@dataclass
class CephRGW:
    """A one-node Ceph cluster serving S3 at ``endpoint``, with one user (``access_key``/``secret_key``).

    :meth:`kill` and :meth:`restart` act on the gateway only: the OSD keeps its objects in memory, so a
    restarted gateway serves what was written before."""

    endpoint: str
    access_key: str
    secret_key: str
    workdir: Path
    conf: Path
    rgw_port: int
    started_in_s: float = 0.0
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    def _run(self, *argv: str, timeout_s: float = 60.0) -> str:
        done = subprocess.run(
            [*argv, "-c", str(self.conf)], capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise ServiceUnavailable(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr[-2000:]}")
        return done.stdout

    def _start_rgw(self) -> None:
        log = self.workdir / "rgw.out"
        self._procs["rgw"] = _spawn(["radosgw", "-f", "-c", str(self.conf), "-n", "client.rgw.a"], log)
        _wait_until("radosgw", lambda: _port_open(self.rgw_port), 60.0, self.workdir / "rgw.log")

    def kill(self) -> None:
        """Stop the S3 gateway abruptly (SIGKILL); the cluster behind it keeps running."""
        proc = self._procs.pop("rgw", None)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def pause(self) -> None:
        """Freeze the gateway (SIGSTOP): it accepts connections and answers nothing, like a hung server."""
        proc = self._procs.get("rgw")
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        proc = self._procs.get("rgw")
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Start the gateway again on the same port."""
        self.kill()
        self._start_rgw()

    def stop(self) -> None:
        for name in ("rgw", "osd", "mon"):
            _stop_process(self._procs.pop(name, None))


def _ceph_conf(workdir: Path, fsid: str, mon_port: int, rgw_port: int) -> str:
    # ms_*_mode=crc: with the default "secure" modes RGW hangs in AUTH_CONNECTING on this machine.
    # tcp_nodelay=1: without it small S3 requests wait on Nagle + delayed ACK (~40 ms each).
    return f"""[global]
fsid = {fsid}
mon_host = v2:{LOOPBACK}:{mon_port}
mon_initial_members = a
public_addr = {LOOPBACK}
cluster_addr = {LOOPBACK}
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
ms_cluster_mode = crc
ms_service_mode = crc
ms_client_mode = crc
ms_mon_cluster_mode = crc
ms_mon_service_mode = crc
ms_mon_client_mode = crc
ms_bind_msgr1 = false
run_dir = {workdir}/run
admin_socket = {workdir}/run/$name.asok
log_file = {workdir}/$name.log
pid_file = {workdir}/run/$name.pid
mon_data = {workdir}/mon/$name
osd_data = {workdir}/osd/$name
osd_objectstore = memstore
memstore_device_bytes = 1073741824
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
# The test cluster keeps a few MiB on the monitor's filesystem: a busy shared disk (95% used) must
# not stop it (ceph-mon exits at start below mon_data_avail_crit, 5% by default).
mon_data_avail_crit = 1
mon_data_avail_warn = 2
mon_allow_pool_delete = true
mon_max_pg_per_osd = 1000
mon_warn_on_pool_no_redundancy = false
osd_pool_default_pg_autoscale_mode = off
mon_osd_full_ratio = 0.99
mon_osd_nearfull_ratio = 0.98
osd_max_object_name_len = 256
osd_max_object_namespace_len = 64

[client.rgw.a]
rgw_frontends = beast endpoint={LOOPBACK}:{rgw_port} tcp_nodelay=1
rgw_dns_name = {LOOPBACK}
rgw_thread_pool_size = 32
rgw_enable_usage_log = false
rgw_init_timeout = 60
"""


def start_ceph_rgw(tmpdir: Path | str) -> CephRGW:
    """Bring up mon + memstore OSD + RGW on free loopback ports and create an S3 user (~15 s here).

    The caller must ``stop()`` it; if start-up fails half way, what did start is stopped here."""
    missing = [b for b in _CEPH_BINARIES if shutil.which(b) is None]
    if missing:
        raise ServiceUnavailable(
            f"Ceph is not installed (missing {', '.join(missing)}); run scripts/services/install_ceph.sh"
        )
    t0 = time.monotonic()
    workdir = Path(tmpdir) / f"ceph-{uuid.uuid4().hex[:8]}"
    for sub in ("run", "mon", "osd"):
        (workdir / sub).mkdir(parents=True)
    fsid = str(uuid.uuid4())
    mon_port, rgw_port = free_port(), free_port()
    conf = workdir / "ceph.conf"
    conf.write_text(_ceph_conf(workdir, fsid, mon_port, rgw_port))
    rgw = CephRGW(
        endpoint=f"http://{LOOPBACK}:{rgw_port}",
        access_key=uuid.uuid4().hex[:20].upper(),
        secret_key=uuid.uuid4().hex + uuid.uuid4().hex[:8],
        workdir=workdir,
        conf=conf,
        rgw_port=rgw_port,
    )
    try:
        monmap = workdir / "monmap"
        subprocess.run(
            [
                "monmaptool",
                "--create",
                "--fsid",
                fsid,
                "--addv",
                "a",
                f"[v2:{LOOPBACK}:{mon_port}]",
                str(monmap),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        rgw._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(monmap))
        rgw._procs["mon"] = _spawn(["ceph-mon", "-f", "-i", "a", "-c", str(conf)], workdir / "mon.out")
        _wait_until("ceph-mon", lambda: _port_open(mon_port), 30.0, workdir / "mon.a.log")
        osd_uuid = str(uuid.uuid4())
        osd_id = rgw._run("ceph", "osd", "new", osd_uuid).strip()
        (workdir / "osd" / f"osd.{osd_id}").mkdir()
        rgw._run("ceph-osd", "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid)
        rgw._procs["osd"] = _spawn(["ceph-osd", "-f", "-i", osd_id, "-c", str(conf)], workdir / "osd.out")

        def osd_up() -> bool:
            out = subprocess.run(
                ["ceph", "osd", "stat", "-f", "json", "-c", str(conf)],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout
            try:
                return int(json.loads(out).get("num_up_osds", 0)) >= 1
            except ValueError:
                return False

        _wait_until("ceph-osd", osd_up, 60.0, workdir / f"osd.{osd_id}.log")
        rgw._start_rgw()
        rgw._run(
            "radosgw-admin",
            "user",
            "create",
            "--uid",
            "ucm-test",
            "--display-name",
            "UCM tests",
            "--access-key",
            rgw.access_key,
            "--secret",
            rgw.secret_key,
        )
        _wait_until("RGW S3 endpoint", lambda: _s3_answers(rgw.endpoint), 30.0, workdir / "rgw.log")
    except BaseException:
        rgw.stop()
        raise
    rgw.started_in_s = time.monotonic() - t0
    return rgw


def _s3_answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint, timeout=2) as resp:
            return int(resp.status) < 500
    except urllib.error.HTTPError as err:
        return err.code < 500
    except OSError:
        return False


# -- pytest fixtures (import them into a test module or a conftest to use) ---------------------------------


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A master for the module's tests; skips them, saying why, when Mooncake is not installed."""
    try:
        master = start_mooncake_master(tmp_path_factory.mktemp("mooncake"))
    except ServiceUnavailable as exc:
        pytest.skip(f"Mooncake master unavailable: {exc}")
    yield master
    master.stop()


@pytest.fixture(scope="module")
def ceph_rgw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CephRGW]:
    """An S3 endpoint for the module's tests (~13 s to start); skips them, saying why, without Ceph."""
    try:
        server = start_ceph_rgw(tmp_path_factory.mktemp("ceph"))
    except ServiceUnavailable as exc:
        pytest.skip(f"Ceph RGW unavailable: {exc}")
    yield server
    server.stop()


if __name__ == "__main__":
    # Manual check: `python tests/support/services.py /tmp/x` starts both, prints timings, stops them.
    where = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ucm-services")
    m = start_mooncake_master(where)
    print(json.dumps({"mooncake_master": m.address, "start_s": round(m.started_in_s, 2)}))
    m.stop()
    c = start_ceph_rgw(where)
    print(json.dumps({"rgw": c.endpoint, "start_s": round(c.started_in_s, 2)}))
    c.stop()
