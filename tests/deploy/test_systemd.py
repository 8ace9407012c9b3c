"""deploy/systemd/ucm-server.service under a real systemd.

systemd runs as PID 1 in a ``--privileged`` podman container (tests/deploy/systemd-host.Containerfile)
holding the unit, the example config (sized down for a test machine) and the user made as the unit's
header says. The unit is started by systemd at boot with all its hardening options; a client (the same
roundtrip.py, as user ucm) dumps and loads blocks through the unit's socket; then the daemon is
restarted, SIGKILLed (Restart=on-failure brings it back) and given a broken config (exit 2, not
restarted). The journal tags its lines ``ucm-server``, the socket is 0600 and owned by uid 10001.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import podman as pm
from support.podman import UCM_UID, Container

pytestmark = pytest.mark.deploy  # boots systemd in podman: not part of `make test-fast`

UNIT = pm.ROOT / "deploy" / "systemd" / "ucm-server.service"
CONFIG = pm.ROOT / "deploy" / "systemd" / "ucm.yaml"
CONTAINERFILE = Path(__file__).parent / "systemd-host.Containerfile"
ROUNDTRIP = Path(__file__).parent / "roundtrip.py"
SOCKET = "/run/ucm/ucm.sock"


def sized_for_tests(text: str) -> str:
    """The example config with its sizes cut to fit a test machine (16 GiB of Cache would not)."""
    out = []
    sizes = {
        "cache_capacity": "cache_capacity: 64MiB\ncache_prefault: false",
        "posix_capacity": "posix_capacity: 1GiB",
    }
    for line in text.splitlines():
        out.append(sizes.get(line.partition(":")[0], line))
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def systemd_image(
    base_images: tuple[str, str], server_image: str, tmp_path_factory: pytest.TempPathFactory
) -> str:
    context = tmp_path_factory.mktemp("systemd-host")
    shutil.copy(UNIT, context / UNIT.name)
    (context / "ucm.yaml").write_text(sized_for_tests(CONFIG.read_text()))
    name = f"localhost/ucm-systemd-host:test-{pm.digest([CONTAINERFILE, UNIT, CONFIG])}-{server_image[-12:]}"
    if not pm.image_exists(name):
        pm.podman(
            "build",
            "--network",
            "host",
            "--build-arg",
            f"BASE={base_images[0]}",
            "--build-arg",
            f"SERVER_IMAGE={server_image}",
            "-f",
            str(CONTAINERFILE),
            "-t",
            name,
            str(context),
            timeout=600,
        )
    return name


class Host:
    """The systemd container: run commands in it, as root or as the unit's user."""

    def __init__(self, container: Container) -> None:
        self.c = container

    def sh(self, script: str, user: str | None = None, check: bool = True) -> str:
        return self.c.exec("sh", "-c", script, user=user, check=check)

    def rc(self, script: str, user: str | None = None) -> int:
        return self.c.exec_rc("sh", "-c", script, user=user).returncode

    def show(self, prop: str) -> str:
        return self.sh(f"systemctl show -p {prop} --value ucm-server").strip()

    def wait_serving(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (
                self.rc("/opt/ucm/bin/ucm-admin --config /etc/ucm/ucm.yaml --timeout 5 -q health", user="ucm")
                == 0
            ):
                return
            time.sleep(0.5)
        raise AssertionError(f"ucm-server never served:\n{self.journal()}")

    def wait_state(self, want: str, timeout_s: float = 30) -> str:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.show("ActiveState")
            if state == want:
                return state
            time.sleep(0.3)
        raise AssertionError(f"ucm-server is {state}, not {want}:\n{self.journal()}")

    def journal(self) -> str:
        return self.sh("journalctl -u ucm-server --no-pager -n 60", check=False)

    def roundtrip(self, action: str, seed: str, count: int) -> dict[str, object]:
        out = self.sh(f"/opt/ucm/bin/python /roundtrip.py {SOCKET} {action} {seed} {count}", user="ucm")
        result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
        return result


@pytest.fixture(scope="module")
def host(systemd_image: str) -> Iterator[Host]:
    c = Container.run(
        systemd_image,
        ["--privileged", "--systemd=always", "--network", "none", "-v", f"{ROUNDTRIP}:/roundtrip.py:ro"],
    )
    try:
        h = Host(c)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # boot: "running" or "degraded" (some host units cannot start)
            state = h.sh("systemctl is-system-running", check=False).strip()
            if state in ("running", "degraded"):
                break
            time.sleep(0.5)
        h.wait_state("active")
        h.wait_serving()
        yield h
    finally:
        c.remove()


def test_unit_starts_at_boot_as_ucm_with_an_owner_only_socket(host: Host) -> None:
    pid = host.show("MainPID")
    assert pid != "0"
    assert host.sh(f"awk '/^Uid:/{{print $2}}' /proc/{pid}/status").strip() == str(UCM_UID)
    # An absolute ExecStart, so the process is ucm-server's Python, not /usr/bin/env.
    assert host.sh(f"cat /proc/{pid}/cmdline | tr '\\0' ' '").split()[1:3] == [
        "/opt/ucm/bin/ucm-server",
        "--config",
    ]
    assert host.sh(f"stat -c '%u %a %F' {SOCKET}").strip() == f"{UCM_UID} 600 socket"
    assert host.sh("stat -c '%u %a' /run/ucm /var/lib/ucm").split() == [str(UCM_UID), "700"] * 2
    # The hardening really applies: the file system is read-only outside the unit's directories.
    ro = host.sh(f"grep -c ' ro,' /proc/{pid}/mountinfo || true").strip()
    assert int(ro or 0) > 0, "ProtectSystem=strict left no read-only mount"


def test_journal_tags_lines_ucm_server(host: Host) -> None:
    """SyslogIdentifier=ucm-server, not "env"."""
    tagged = host.sh("journalctl -t ucm-server --no-pager -o cat", check=False)
    assert "metrics at http://127.0.0.1:9464/metrics" in tagged or "serving" in tagged.lower(), tagged[-2000:]
    assert host.sh("journalctl -t env --no-pager -q -o cat", check=False).strip() == ""


def test_dump_load_restart_and_kill(host: Host) -> None:
    assert host.roundtrip("dump", "unit", 8)["ok"]
    assert host.roundtrip("load", "unit", 8)["equal"]

    host.sh("systemctl restart ucm-server")  # SIGTERM: write-back drains, the index is rebuilt
    host.wait_serving()
    assert host.roundtrip("lookup", "unit", 8)["hit_prefix"] == 8
    assert host.roundtrip("load", "unit", 8)["equal"]

    before = int(host.show("NRestarts"))
    host.sh("systemctl kill --signal=SIGKILL ucm-server")  # a crash: Restart=on-failure brings it back
    deadline = time.monotonic() + 30
    while int(host.show("NRestarts")) == before and time.monotonic() < deadline:
        time.sleep(0.3)
    assert int(host.show("NRestarts")) == before + 1, host.journal()
    host.wait_state("active")
    host.wait_serving()
    assert host.roundtrip("load", "unit", 8)["equal"]


def test_config_error_is_not_restarted(host: Host) -> None:
    """Exit 2 (a bad key) stops the unit for good (RestartPreventExitStatus=2), with the key in the log."""
    host.sh("cp /etc/ucm/ucm.yaml /etc/ucm/ucm.yaml.good && echo 'no_such_key: 1' >> /etc/ucm/ucm.yaml")
    try:
        host.sh("systemctl restart ucm-server", check=False)  # a manual restart zeroes NRestarts
        host.wait_state("failed")
        time.sleep(3)  # RestartSec=2s: a restart would have happened by now
        assert host.show("ActiveState") == "failed"
        assert host.show("NRestarts") == "0", host.journal()
        assert host.show("ExecMainStatus") == "2"
        assert "no_such_key" in host.journal()
    finally:
        host.sh("mv /etc/ucm/ucm.yaml.good /etc/ucm/ucm.yaml && systemctl reset-failed ucm-server")
    host.sh("systemctl start ucm-server")
    host.wait_serving()
