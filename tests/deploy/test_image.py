"""The ucm-server image for real (issue #16): built with podman from a locally bootstrapped base, run,
probed by its own HEALTHCHECK, used from the host through the mounted socket, restarted, re-created.

One daemon container per test module (``served``) carries most checks; each check says which item of
issue #16 it shows. Skips, with the reason, where podman cannot run (see tests/support/podman.py).

Shared memory: clients hand their memory to the daemon as file descriptors over the mounted socket
directory (issue #11), so no container here shares the host's /dev/shm or IPC namespace: the host
client's dumps and loads going through prove it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import podman as pm
from support.podman import UCM_UID, Container, HostDirs, client, container_client, make_host_dirs
from support.services import free_port

SOCKET_NAME = "daemon.sock"  # not the image's ucm.sock: the HEALTHCHECK must follow the config


def daemon_args(dirs: HostDirs, *extra: str) -> list[str]:
    """The daemon container as deploy/k8s runs it: read-only root file system, no capabilities, no
    privilege escalation (the DaemonSet's securityContext), host directories for socket and blocks."""
    return [
        "--read-only",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--network",
        "host",
        "--stop-timeout",
        "60",
        "-v",
        f"{dirs.run}:/run/ucm",
        "-v",
        f"{dirs.data}:/var/lib/ucm",
        "-v",
        f"{dirs.etc}:/etc/ucm:ro",
        *extra,
    ]


def write_config(dirs: HostDirs, metrics_port: int) -> None:
    """The operator's config, mounted over the image's /etc/ucm: a loopback metrics port, another socket."""
    (dirs.etc / "ucm.yaml").write_text(
        f"socket: /run/ucm/{SOCKET_NAME}\n"
        "data_dir: /var/lib/ucm\n"
        f"metrics_address: 127.0.0.1:{metrics_port}\n"
        'store_pipeline: "Cache|Posix"\n'
        "cache_capacity: 64MiB\n"
        "cache_prefault: false\n"
        "write_mode: write-back\n"
    )
    (dirs.etc / "ucm.yaml").chmod(0o644)


def metrics(port: int, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
        text: str = r.read().decode()
        return text


def outside_address() -> str | None:
    """One of this host's non-loopback addresses (routing lookup only, nothing is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 9))
        addr: str = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if addr.startswith("127.") else addr


@dataclass
class Served:
    image: str
    dirs: HostDirs
    port: int
    container: Container
    first_health: float  # seconds from `podman run` to a passing HEALTHCHECK

    @property
    def socket(self) -> Path:
        return self.dirs.run / SOCKET_NAME


@pytest.fixture(scope="module")
def served(server_image: str) -> Iterator[Served]:
    dirs = make_host_dirs()
    port = free_port()
    write_config(dirs, port)
    start = time.monotonic()
    c = Container.run(server_image, daemon_args(dirs))
    served = Served(server_image, dirs, port, c, 0.0)
    try:
        c.wait_healthy()
        served.first_health = time.monotonic() - start
        yield served
    finally:
        c.remove()
        served.container.remove()  # a test may have replaced it (re-created container)
        shutil.rmtree(dirs.root, ignore_errors=True)


# -- the image ------------------------------------------------------------------------------------------
def test_image_keeps_its_healthcheck_and_runs_as_10001(server_image: str) -> None:
    """Item 3: built with --format docker, the HEALTHCHECK survives; the config is the daemon's."""
    info = json.loads(pm.podman("image", "inspect", server_image))[0]
    config = info["Config"]
    health = info.get("Healthcheck") or config.get("Healthcheck")
    assert health, "the image has no HEALTHCHECK (built without --format docker?)"
    assert "ucm-admin --timeout 5 -q health" in " ".join(health["Test"])
    assert config["User"] == f"{UCM_UID}:{UCM_UID}"
    assert config["Entrypoint"] == ["ucm-server"]
    # Item 1: no UCM_* setting that would beat a mounted config file; one variable names the file, for
    # the daemon and ucm-admin alike.
    ucm_env = [e for e in config.get("Env", []) if e.startswith("UCM_")]
    assert ucm_env == ["UCM_SERVER_CONFIG=/etc/ucm/ucm.yaml"], config["Env"]


def test_image_holds_the_daemon_and_nothing_to_install_with(server_image: str) -> None:
    """Items 4 and the "no torch/vllm" rule: no client libraries, no pip, no setuptools, pinned deps."""
    script = (
        "import importlib.util as u, importlib.metadata as m, json, sys\n"
        "names = ['torch', 'vllm', 'cupy', 'pip', 'setuptools', 'ensurepip', 'ucm_server', 'grpc']\n"
        "found = {n: u.find_spec(n) is not None for n in names}\n"
        "dists = {d.metadata['Name'].lower(): d.version for d in m.distributions()}\n"
        "print(json.dumps({'found': found, 'dists': dists}))\n"
    )
    out = pm.podman("run", "--rm", "--no-healthcheck", "--entrypoint", "python3", server_image, "-c", script)
    seen = json.loads(out)
    found = seen["found"]
    assert found["ucm_server"] and found["grpc"]
    present = [n for n in ("torch", "vllm", "cupy", "pip", "setuptools", "ensurepip") if found[n]]
    assert not present, f"the runtime image holds {present}"
    # Every installed distribution is the version constraints.txt pins (the package itself aside).
    pins = {}
    for line in (pm.ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    dists = {k.replace("_", "-"): v for k, v in seen["dists"].items()}
    dists.pop("ucm")
    assert dists, "no distributions found in the image's venv"
    for name, version in dists.items():
        assert pins.get(name) == version, (
            f"{name}=={version} in the image, constraints.txt pins {pins.get(name)}"
        )
    # Nor anything pip could bootstrap from: no wheels of pip/setuptools anywhere in the file system.
    leftovers = pm.podman(
        "run",
        "--rm",
        "--no-healthcheck",
        "--user",
        "0",
        "--entrypoint",
        "sh",
        server_image,
        "-c",
        "find / -xdev -path '*/site-packages/ucm_client' -prune -o \\( "
        + " -o ".join(f"-name {n} -o -name '{n}-*'" for n in ("pip", "setuptools", "torch", "vllm", "cupy"))
        + " \\) -print",
    )
    assert not leftovers.strip(), leftovers


# -- the running daemon ------------------------------------------------------------------------------
def test_healthcheck_passes_on_the_configured_socket(served: Served) -> None:
    """Item 1: the HEALTHCHECK probes the socket the mounted config names (not the image's default)."""
    assert served.container.health_status() == "healthy"
    assert served.socket.exists() and not (served.dirs.run / "ucm.sock").exists()
    assert served.first_health < 60, f"first healthy after {served.first_health:.1f} s"


def test_admin_tool_in_the_container_finds_the_daemon_with_no_flag(served: Served) -> None:
    """`docker exec ucm ucm-admin health` / `stats`, exactly as an operator types them: the image's
    UCM_SERVER_CONFIG leads the admin tool to the socket of the mounted config (daemon.sock, not the
    image's default ucm.sock, so following the file is what finds it)."""
    health = served.container.exec_rc("ucm-admin", "health")
    assert health.returncode == 0, health.stdout + health.stderr
    assert f"SERVING unix:///run/ucm/{SOCKET_NAME}" in health.stdout
    stats = served.container.exec_rc("ucm-admin", "stats")
    assert stats.returncode == 0, stats.stdout + stats.stderr
    assert f" at unix:///run/ucm/{SOCKET_NAME}" in stats.stdout and "Posix" in stats.stdout
    # negative control: without the variable the admin tool looks at its per-user default and says so
    lost = served.container.exec_rc("env", "-u", "UCM_SERVER_CONFIG", "ucm-admin", "health")
    assert lost.returncode == 3 and "no ucm-server socket at" in lost.stderr, lost.stderr


def test_metrics_follow_the_mounted_config(served: Served) -> None:
    """Item 1: `metrics_address: 127.0.0.1:PORT` in the mounted file is what the daemon listens on."""
    assert "ucm_sessions" in metrics(served.port)
    logs = served.container.logs()
    assert f"127.0.0.1:{served.port}" in logs and "0.0.0.0:9464" not in logs, logs[-2000:]
    addr = outside_address()
    if addr is None:
        pytest.skip("no non-loopback address on this host to show the port is not reachable there")
    with pytest.raises(urllib.error.URLError):
        metrics(served.port, host=addr)


def test_non_root_and_owner_only_socket(served: Served) -> None:
    """The daemon runs as uid 10001; its socket is 0600 in a 0700 directory, as seen from the host."""
    assert served.container.exec("id", "-u").strip() == str(UCM_UID)
    # It serves with the root file system read-only and no capabilities (as in the DaemonSet).
    assert served.container.exec_rc("touch", "/opt/ucm/probe").returncode != 0
    cap_eff = served.container.exec("sh", "-c", "awk '/^CapEff:/{print $2}' /proc/1/status").strip()
    assert int(cap_eff, 16) == 0, cap_eff
    pid1_uid = served.container.exec("sh", "-c", "awk '/^Uid:/{print $2}' /proc/1/status").strip()
    assert pid1_uid == str(UCM_UID)
    st = served.socket.stat()
    assert stat.S_ISSOCK(st.st_mode) and st.st_uid == UCM_UID
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(served.dirs.run.stat().st_mode) == 0o700


def test_dump_load_restart_recreate(served: Served) -> None:
    """From the host through the mounted socket: blocks dumped are loaded back byte for byte, after a
    restart (SIGTERM: write-back drains) and after SIGKILL + re-creating the container (a new container
    on the same volumes, here told its socket by UCM_SOCKET: the HEALTHCHECK follows that too).
    Item 7: every directory the daemon made in the data dir is owner-only."""
    c = served.container
    assert client(served.socket, "dump", "first", 8)["ok"]
    assert client(served.socket, "load", "first", 8) == {"action": "load", "ok": True, "equal": True}
    # From a second container, as vLLM in its own container would: only the socket directory (and, in
    # the old world, /dev/shm) mounted.
    mounts = ["-v", f"{served.dirs.run}:/run/ucm"]
    sock_in = f"/run/ucm/{SOCKET_NAME}"
    assert container_client(served.image, mounts, sock_in, "load", "first", 8)["equal"]

    pm.podman("restart", "--time", "60", c.name, timeout=120)
    c.wait_healthy()
    assert client(served.socket, "lookup", "first", 8)["hit_prefix"] == 8
    assert client(served.socket, "load", "first", 8)["equal"]
    assert client(served.socket, "dump", "second", 4)["ok"]

    pm.podman("stop", "--time", "60", c.name, timeout=120)  # drains "second" to disk
    pm.podman("rm", c.name)
    moved = Container.run(served.image, daemon_args(served.dirs, "-e", "UCM_SOCKET=/run/ucm/moved.sock"))
    served.container = moved
    moved.wait_healthy()
    sock = served.dirs.run / "moved.sock"
    for seed, n in (("first", 8), ("second", 4)):
        assert client(sock, "load", seed, n)["equal"], seed

    pm.podman("kill", "--signal", "KILL", moved.name)
    moved.wait_exit()
    pm.podman("start", moved.name)
    moved.wait_healthy()
    assert client(sock, "load", "first", 8)["equal"]

    dirs = [Path(p) for p, _, _ in os.walk(served.dirs.data)]
    assert len(dirs) > 2, dirs
    loose = [f"{d} {stat.S_IMODE(d.stat().st_mode):o}" for d in dirs if d.stat().st_mode & 0o077]
    assert not loose, f"directories in the data dir open to group/other: {loose}"


# -- host directories -------------------------------------------------------------------------------
def test_tmpfiles_rule_recreates_the_socket_directory(server_image: str, host_dirs: HostDirs) -> None:
    """Item 2: after a reboot /run is empty. Without the rule the runtime makes the bind source
    root-owned 0755 and the daemon exits 2 at once (the config error restarting cannot fix); with the
    shipped tmpfiles.d rule (deploy/image/ucm-tmpfiles.conf, run here by systemd-tmpfiles as at boot)
    the directory is back as 10001:10001 0700 and the daemon serves."""
    write_config(host_dirs, free_port())
    host_dirs.run.rmdir()
    host_dirs.run.mkdir(mode=0o755)  # what Docker recreates for a missing bind source after a reboot
    os.chown(host_dirs.run, 0, 0)
    broken = Container.run(server_image, daemon_args(host_dirs))
    try:
        assert broken.wait_exit() == 2, broken.logs()
        assert str(Path("/run/ucm")) in broken.logs(), broken.logs()
    finally:
        broken.remove()

    boot = host_dirs.root / "boot"
    rule = pm.IMAGE_DIR / "ucm-tmpfiles.conf"
    proc = subprocess.run(
        ["systemd-tmpfiles", "--create", f"--root={boot}", str(rule)], capture_output=True, text=True
    )
    if proc.returncode != 0 and "not found" in proc.stderr:
        pytest.skip(f"systemd-tmpfiles cannot run here: {proc.stderr}")
    assert proc.returncode == 0, proc.stderr
    run, data = boot / "run" / "ucm", boot / "var" / "lib" / "ucm"
    for d in (run, data):
        st = d.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (UCM_UID, UCM_UID, 0o700), d
    fixed = HostDirs(host_dirs.root, run, data, host_dirs.etc)
    c = Container.run(server_image, daemon_args(fixed))
    try:
        c.wait_healthy()
        assert client(run / SOCKET_NAME, "dump", "tmpfiles", 2)["ok"]
    finally:
        c.remove()


def test_baked_in_config_serves_as_documented(server_image: str, host_dirs: HostDirs) -> None:
    """With nothing but the two volumes (the docs' `docker run` line, on podman's default bridge network):
    the image's own /etc/ucm/ucm.yaml puts the socket at /run/ucm/ucm.sock and the metrics on
    0.0.0.0:9464 inside the container, so a published port reaches them from the host."""
    port = free_port()
    args = ["--stop-timeout", "60", "-v", f"{host_dirs.run}:/run/ucm", "-v", f"{host_dirs.data}:/var/lib/ucm"]
    c = Container.run(server_image, [*args, "-p", f"127.0.0.1:{port}:9464"])
    try:
        c.wait_healthy()
        sock = host_dirs.run / "ucm.sock"
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert client(sock, "dump", "baked", 2)["ok"]
        assert client(sock, "load", "baked", 2)["equal"]
        deadline = time.monotonic() + 20
        while True:  # the port forward may need a moment after the daemon is up
            try:
                assert "ucm_tier_blocks" in metrics(port)
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        c.remove()
