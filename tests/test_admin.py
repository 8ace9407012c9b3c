"""``ucm-admin`` end to end: the real command as a subprocess against a real daemon.

Each test checks what a script relies on: the exit code, the JSON document on stdout, and a message
on stderr that says what went wrong. Read-only checks share one seeded daemon; tests that change the
store get their own.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.admin_cli import admin, json_of, run_admin
from support.blocks import NS, blocks_in
from support.posix_files import find_block, flip_payload_byte

from ucm_client import SharedBuffer, UcmClient, namespace_id
from ucm_server.testing.daemon import DaemonProcess

REPO = Path(__file__).resolve().parents[1]
OTHER_NS = namespace_id(model="pytest-admin-other", dtype="uint8")
BLOCK = 4096


def key_text(namespace: bytes, digest: bytes) -> str:
    return f"{namespace.hex()}/{digest.hex()}"


def seed(client: UcmClient, buf: SharedBuffer, namespace: bytes, count: int, first: int = 0) -> list[str]:
    """Dump ``count`` blocks durably (so they are in the Posix tier too); return their printed keys."""
    region = client.register(buf)
    buf.buf[: count * BLOCK] = os.urandom(count * BLOCK)
    blocks = blocks_in(region, count, BLOCK, first=first)
    assert client.wait(client.dump(namespace, blocks, wait_durable=True), 30).ok
    return [key_text(namespace, b.key) for b in blocks]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, list[str], list[str]]]:
    """One daemon for the read-only tests: 5 blocks in NS, 3 in OTHER_NS."""
    with (
        DaemonProcess(tmp_path_factory.mktemp("admin") / "ucm", args=["--cache-capacity", "64MiB"]) as d,
        UcmClient(d.target, client_name="pytest-admin") as client,
        SharedBuffer(1 << 20) as buf,
    ):
        ours = seed(client, buf, NS, 5)
        others = seed(client, buf, OTHER_NS, 3, first=100)
        client.lookup(NS, [bytes.fromhex(k.split("/")[1]) for k in ours])
        yield d, sorted(ours), sorted(others)


# -- read-only -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_health_serving(seeded: tuple[DaemonProcess, list[str], list[str]]) -> None:
    d, _, _ = seeded
    proc = admin(d, "health")
    assert proc.returncode == 0, proc.stderr
    assert "SERVING" in proc.stdout
    assert json_of(admin(d, "--json", "health"))["status"] == "SERVING"
    unknown = admin(d, "health", "--service", "no.such.Service")
    assert unknown.returncode == 1 and "no health status" in unknown.stderr


@pytest.mark.slow
def test_stats_human_and_json(seeded: tuple[DaemonProcess, list[str], list[str]]) -> None:
    d, _, _ = seeded
    human = admin(d, "stats")
    assert human.returncode == 0, human.stderr
    for word in ("TIER", "Cache", "Posix", "HIT RATE", "EVICTIONS", "64 MiB"):
        assert word in human.stdout
    data = json_of(admin(d, "stats", "--json"))  # global option after the command works too
    tiers = {t["name"]: t for t in data["tiers"]}
    assert set(tiers) == {"Cache", "Posix"}
    assert tiers["Cache"]["capacity_bytes"] == 64 << 20
    assert tiers["Posix"]["blocks"] == 8 and tiers["Posix"]["bytes"] == 8 * BLOCK
    assert {"hit_rate", "evictions", "hits", "misses"} <= set(tiers["Cache"])
    assert data["store_pipeline"] == "Cache|Posix" and data["lookup_hit_rate"] == 1.0


@pytest.mark.slow
def test_ls_filters_by_namespace_and_pages(seeded: tuple[DaemonProcess, list[str], list[str]]) -> None:
    d, ours, others = seeded
    everything = json_of(admin(d, "--json", "ls"))
    assert everything["total"] == 8 and everything["next_page_token"] == ""
    page1 = json_of(admin(d, "--json", "ls", "--namespace", NS.hex(), "--limit", "2"))
    assert page1["total"] == 5 and [b["key"] for b in page1["blocks"]] == ours[:2]
    assert page1["next_page_token"]
    page2 = json_of(
        admin(
            d,
            "--json",
            "ls",
            "--namespace",
            NS.hex(),
            "--limit",
            "2",
            "--page-token",
            page1["next_page_token"],
        )
    )
    assert [b["key"] for b in page2["blocks"]] == ours[2:4]
    quiet = admin(d, "-q", "ls", "--namespace", OTHER_NS.hex(), "--all")
    assert quiet.stdout.split() == others
    human = admin(d, "ls", "--namespace", NS.hex(), "--limit", "2")
    assert ours[0] in human.stdout and "--page-token" in human.stderr


@pytest.mark.slow
def test_inspect_found_and_not_found(seeded: tuple[DaemonProcess, list[str], list[str]]) -> None:
    d, ours, _ = seeded
    block = json_of(admin(d, "--json", "inspect", ours[0]))
    assert block["key"] == ours[0] and block["size"] == BLOCK
    assert set(block["tiers"]) == {"Cache", "Posix"} and block["checksum"]
    assert ours[0] in admin(d, "inspect", ours[0]).stdout
    missing = f"{NS.hex()}/{'ab' * 32}"
    proc = admin(d, "inspect", missing)
    assert proc.returncode == 1
    assert "in no tier" in proc.stderr and proc.stdout == ""
    err = json_of(admin(d, "--json", "inspect", missing))["error"]
    assert err["exit_code"] == 1 and err["type"] == "not_found"


def test_verify_clean(seeded: tuple[DaemonProcess, list[str], list[str]]) -> None:
    d, _, _ = seeded
    proc = admin(d, "--json", "verify")
    assert proc.returncode == 0, proc.stderr
    assert json_of(proc) == {"checked": 8, "total": 8, "corrupt": 0, "corrupt_blocks": []}


@pytest.mark.slow
def test_watch_stops_after_count(seeded: tuple[DaemonProcess, list[str], list[str]]) -> None:
    d, _, _ = seeded
    proc = admin(d, "--json", "watch", "--count", "2", "--interval", "0.1")
    assert proc.returncode == 0, proc.stderr
    samples = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [s["sample"] for s in samples] == [1, 2]
    assert set(samples[1]["rates"]) == {"Cache", "Posix"}
    human = admin(d, "watch", "--count", "2", "--interval", "0.1")
    assert human.returncode == 0 and human.stdout.count("READ/s") == 2


def test_daemon_error_exits_4(seeded: tuple[DaemonProcess, list[str], list[str]]) -> None:
    d, _, _ = seeded
    proc = admin(d, "ls", "--tier", "NoSuchTier")
    assert proc.returncode == 4
    assert "unknown tier 'NoSuchTier'" in proc.stderr


@pytest.mark.slow
def test_bench_reports_throughput(seeded: tuple[DaemonProcess, list[str], list[str]]) -> None:
    d, _, _ = seeded
    proc = admin(d, "--json", "bench", "--blocks", "4", "--block-size", "64KiB", "--rounds", "1")
    assert proc.returncode == 0, proc.stderr
    data = json_of(proc)
    assert data["dump"]["best_gib_s"] > 0 and data["load"]["best_gib_s"] > 0
    assert json_of(admin(d, "--json", "stats"))["tiers"][1]["blocks"] == 8  # bench cleaned up


# -- changing the store -----------------------------------------------------------------------------
@pytest.mark.slow
def test_delete_named_and_from_stdin(daemon: DaemonProcess, client: UcmClient, shm: SharedBuffer) -> None:
    keys = seed(client, shm, NS, 4)
    proc = admin(daemon, "--json", "delete", keys[0])
    assert proc.returncode == 0, proc.stderr
    assert json_of(proc) == {"requested": 1, "deleted": 1, "not_found": 0}
    proc = admin(daemon, "delete", "-", stdin="\n".join(keys[1:]) + "\n")
    assert proc.returncode == 0, proc.stderr
    assert json_of(admin(daemon, "--json", "ls"))["total"] == 0
    again = admin(daemon, "delete", keys[0])
    assert again.returncode == 1 and "not stored" in again.stderr
    assert admin(daemon, "delete", "--missing-ok", keys[0]).returncode == 0


@pytest.mark.slow
def test_evict_keys_bytes_and_all(daemon: DaemonProcess, client: UcmClient, shm: SharedBuffer) -> None:
    keys = seed(client, shm, NS, 6)
    proc = admin(daemon, "--json", "evict", "--tier", "Cache", keys[0])
    assert proc.returncode == 0, proc.stderr
    assert json_of(proc) == {"tier": "Cache", "blocks": 1, "bytes": BLOCK}
    assert json_of(admin(daemon, "--json", "inspect", keys[0]))["tiers"] == ["Posix"]
    assert json_of(admin(daemon, "--json", "evict", "--tier", "Cache", "--bytes", "4KiB"))["blocks"] >= 1
    refused = admin(daemon, "evict", "--tier", "Cache", "--all")  # stdin is not a terminal
    assert refused.returncode == 2 and "--yes" in refused.stderr
    done = json_of(admin(daemon, "--json", "evict", "--tier", "Cache", "--all", "--yes"))
    assert done["tier"] == "Cache"
    stats = {t["name"]: t for t in json_of(admin(daemon, "--json", "stats"))["tiers"]}
    assert stats["Cache"]["blocks"] == 0 and stats["Posix"]["blocks"] == 6


@pytest.mark.slow
def test_verify_reports_corrupt_block(daemon: DaemonProcess, client: UcmClient, shm: SharedBuffer) -> None:
    keys = seed(client, shm, NS, 3)
    ns_hex, key_hex = keys[1].split("/")
    stored = find_block(daemon.data_dir / "blocks", bytes.fromhex(ns_hex), bytes.fromhex(key_hex))
    flip_payload_byte(stored, -10, 0xFF)  # one payload byte (counted from the end) behind the daemon's back
    proc = admin(daemon, "--json", "verify")
    assert proc.returncode == 1
    report = json_of(proc)
    assert report["corrupt"] == 1 and report["checked"] == 3
    assert report["corrupt_blocks"][0]["key"] == keys[1]
    assert report["corrupt_blocks"][0]["tier"] == "Posix"
    assert "checksum" in report["corrupt_blocks"][0]["reason"]
    assert "1 corrupt" in proc.stderr


@pytest.mark.slow
def test_verify_human_summary_names_the_key(
    daemon: DaemonProcess, client: UcmClient, shm: SharedBuffer
) -> None:
    keys = seed(client, shm, NS, 2)
    ns_hex, key_hex = keys[0].split("/")
    stored = find_block(daemon.data_dir / "blocks", bytes.fromhex(ns_hex), bytes.fromhex(key_hex))
    flip_payload_byte(stored, -1, 0x01)  # the last payload byte
    proc = admin(daemon, "verify")
    assert proc.returncode == 1
    assert keys[0] in proc.stdout and "1 corrupt" in proc.stdout
    assert "verifying:" in proc.stderr  # plain progress lines when stderr is not a terminal


# -- no daemon, bad arguments ---------------------------------------------------------------------
def test_no_daemon_exits_3_with_a_clear_message(tmp_path: Path) -> None:
    proc = admin(tmp_path / "nothing.sock", "stats")
    assert proc.returncode == 3
    assert "no ucm-server socket at" in proc.stderr and "ucm-server" in proc.stderr
    assert proc.stdout == ""
    err = json_of(admin(tmp_path / "nothing.sock", "--json", "health"))["error"]
    assert err["exit_code"] == 3 and err["type"] == "unreachable"


def test_stale_socket_exits_3_after_timeout(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # a socket file nobody accepts on, as a crashed daemon leaves behind
        proc = admin(path, "--timeout", "0.5", "health")
    assert proc.returncode == 3
    assert "no ucm-server answering" in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["frobnicate"],
        ["ls", "--limit", "0"],
        ["inspect", "not-a-key"],
        ["inspect", "abcd/ef"],
        ["evict", "--tier", "Cache"],
        ["evict", "--tier", "Cache", "--bytes", "lots"],
        ["--json", "--quiet", "stats"],
        ["--json", "stats", "--quiet"],
        ["watch", "--interval", "-1"],
    ],
)
def test_bad_arguments_exit_2(tmp_path: Path, args: list[str]) -> None:
    proc = admin(tmp_path / "unused.sock", *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.strip()


def test_help_teaches_exit_codes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ucm_client.admin", "verify", "--help"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0
    assert "examples:" in proc.stdout and "exit codes:" in proc.stdout


def test_cli_reference_is_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_cli_docs.py"), "--check"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_target_from_environment(seeded: tuple[DaemonProcess, list[str], list[str]]) -> None:
    d, _, _ = seeded
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")} | {"UCM_SOCKET": str(d.socket)}
    proc = subprocess.run(
        [sys.executable, "-m", "ucm_client.admin", "--json", "health"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["target"] == f"unix://{d.socket}"


def test_doctor_passes_against_a_healthy_daemon(seeded: tuple[DaemonProcess, list[str], list[str]]) -> None:
    d, _, _ = seeded
    proc = admin(d, "--json", "doctor", "--skip-sparse")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = {(c["section"], c["name"]): c for c in json_of(proc)["checks"]}
    assert checks[("daemon", "health")]["ok"] is True
    assert checks[("daemon", "socket")]["ok"] is True


@pytest.mark.slow
def test_doctor_reports_missing_daemon_and_sparse_patches(tmp_path: Path) -> None:
    proc = admin(tmp_path / "nothing.sock", "--json", "doctor")
    assert proc.returncode == 1  # a failed check, not exit 3: doctor always reports
    report = json_of(proc)
    failed = [c for c in report["checks"] if c["ok"] is False]
    assert [(c["section"], c["name"]) for c in failed] == [("daemon", "socket")]
    assert any(c["section"] == "sparse" for c in report["checks"])  # present, or "not available"


# -- --config: the daemon's own config file names the socket (container health checks) -------------
def admin_with_config(
    config: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_admin("--config", str(config), *args, env=env)


@pytest.mark.slow
def test_config_option_resolves_the_socket_as_the_daemon_does(
    seeded: tuple[DaemonProcess, list[str], list[str]], tmp_path: Path
) -> None:
    """`ucm-admin --config FILE` talks to the socket FILE names (flat or ``ucm_connectors`` form), with
    UCM_SOCKET beating the file exactly as in ucm-server; a missing file or one that is not YAML is a usage
    error (2) naming it; --config and --socket together are refused. Only the socket is read (the client loads
    no daemon code): another key's mistake is the daemon's to report at start, not the probe's."""
    d, _, _ = seeded
    good, elsewhere, broken = tmp_path / "good.yaml", tmp_path / "elsewhere.yaml", tmp_path / "broken.yaml"
    good.write_text(f"socket: {d.socket}\ncache_capacity: 1GiB\n")
    elsewhere.write_text(f"socket: {tmp_path / 'nobody.sock'}\n")
    broken.write_text("socket: [/x\n")
    seed, typo = tmp_path / "seed.yaml", tmp_path / "typo.yaml"
    seed.write_text(
        "ucm_connectors:\n  - ucm_connector_name: UcmNfsStore\n"
        f"    ucm_connector_config:\n      socket: {d.socket}\n"
    )
    typo.write_text(f"socket: {d.socket}\ncache_capacityy: 1GiB\n")
    assert admin_with_config(seed, "health").returncode == 0
    assert admin_with_config(typo, "health").returncode == 0
    ok = admin_with_config(good, "health")
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    away = admin_with_config(elsewhere, "health")
    assert away.returncode == 3 and "nobody.sock" in away.stderr
    assert admin_with_config(elsewhere, "health", env={"UCM_SOCKET": str(d.socket)}).returncode == 0
    moved = admin_with_config(good, "health", env={"UCM_SOCKET": str(tmp_path / "moved.sock")})
    assert moved.returncode == 3 and "moved.sock" in moved.stderr
    missing = admin_with_config(tmp_path / "absent.yaml", "health")
    assert missing.returncode == 2 and "absent.yaml" in missing.stderr
    bad = admin_with_config(broken, "health")
    assert bad.returncode == 2 and "broken.yaml" in bad.stderr and "not valid YAML" in bad.stderr
    both = admin_with_config(good, "--socket", str(d.socket), "health")
    assert both.returncode == 2 and "not allowed with" in both.stderr
    assert d.healthy()
