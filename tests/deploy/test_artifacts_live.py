"""The deployment artifacts against a real daemon (started with torch, vLLM and cupy made
unimportable, as in the image): the health-check commands of the image and the DaemonSet exit 0 when it
serves and fail when it is unreachable, and every metric and label the Grafana dashboard
(deploy/grafana) uses is one the daemon exports. The static checks are in ``test_artifacts.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.deploy_artifacts import (
    CLIENT_ONLY,
    DASHBOARD,
    IMAGE_CONFIG_PATH,
    Image,
    container,
    pod_spec,
)

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_server.testing.daemon import DaemonProcess


# -- against a real daemon --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def no_client_libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment that makes torch, vllm and cupy unimportable, as they are in the image."""
    site = tmp_path_factory.mktemp("image-site")
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NotInImage:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.partition('.')[0] in {CLIENT_ONLY!r}:\n"
        "            raise ImportError(f'{name} is not in the ucm-server image')\n"
        "        return None\n"
        "sys.meta_path.insert(0, _NotInImage())\n"
    )
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory, no_client_libraries: dict[str, str]
) -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon with some traffic behind it (dump, load, lookup, one failing RPC) and its /metrics text."""
    workdir = tmp_path_factory.mktemp("daemon")
    d = DaemonProcess(workdir, args=["--metrics-address", "127.0.0.1:0"], env=no_client_libraries)
    ns = namespace_id(model="test-deploy", dtype="uint8")
    with d, UcmClient(d.target) as c, SharedBuffer(1 << 20) as buf:
        region = c.register(buf)
        blocks = [BlockIO(key_digest("deploy", i), (Segment(region, i << 16, 1 << 16),)) for i in range(4)]
        assert c.wait(c.dump(ns, blocks), 10).ok
        assert c.wait(c.load(ns, blocks), 10).ok
        assert c.lookup(ns, [b.key for b in blocks] + [b"\0" * 32]).hit_prefix == 4
        with pytest.raises(Exception, match="unknown task"):
            c.check(10**9)  # an RPC error, so ucm_rpc_errors_total has a sample
        match = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", d.log())
        assert match, d.log()
        text = urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}/metrics", timeout=5).read().decode()
        yield d, text


def _admin_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


@pytest.mark.slow
def test_health_check_commands_against_a_real_daemon(
    live: tuple[DaemonProcess, str],
    image: Image,
    manifests: dict[tuple[str, str], dict[str, Any]],
    no_client_libraries: dict[str, str],
    tmp_path: Path,
) -> None:
    """The image's HEALTHCHECK and the DaemonSet's probes, run as written with the config file (the
    image's UCM_SERVER_CONFIG, the probes' --config) swapped for a file naming the live daemon's socket
    (or an absent one). Like ucm-server, they let UCM_SOCKET beat the file, so `docker run -e
    UCM_SOCKET=...` moves the daemon and its health check together."""
    if shutil.which("ucm-admin", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("the ucm-admin entry point is not installed next to this Python")
    d, _ = live
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(f"socket: {d.socket}\n")
    bad.write_text(f"socket: {tmp_path / 'absent.sock'}\n")
    command = image.one("HEALTHCHECK").args.partition("CMD ")[2]
    assert image.env["UCM_SERVER_CONFIG"] == IMAGE_CONFIG_PATH
    cases: list[tuple[Path, dict[str, str], int]] = [
        (good, {}, 0),
        (bad, {}, 1),
        (bad, {"UCM_SOCKET": str(d.socket)}, 0),
        (good, {"UCM_SOCKET": str(tmp_path / "absent.sock")}, 1),
        (tmp_path / "missing.yaml", {}, 1),
    ]
    for config, extra, expected in cases:
        env = _admin_env({**no_client_libraries, "UCM_SERVER_CONFIG": str(config), **extra})
        argv = ["sh", "-c", command]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == expected, (config.name, extra, proc.stderr)
    probe = container(pod_spec(manifests, "DaemonSet", "ucm-server"), "ucm-server")["livenessProbe"]
    cmd = probe["exec"]["command"]
    at = cmd.index("--config") + 1
    for config, expected in ((good, 0), (bad, 3)):
        argv = [*cmd[:at], str(config), *cmd[at + 1 :]]
        proc = subprocess.run(
            argv, env=_admin_env(no_client_libraries), capture_output=True, text=True, timeout=30
        )
        assert proc.returncode == expected, proc.stderr


PROMQL_WORDS = {
    *("by", "without", "on", "ignoring", "group_left", "group_right"),
    *("bool", "and", "or", "unless", "offset", "inf", "nan"),
}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression uses."""
    labels: set[str] = set()
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    for body in re.findall(r"\{([^}]*)\}", text):
        labels |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", body))
    text = re.sub(r"\{[^}]*\}", " ", text)
    for body in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text):
        labels |= {w.strip() for w in body.split(",") if w.strip()}
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    metrics = {
        m.group(1)
        for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)\b(?!\s*\()", text)
        if m.group(1).lower() not in PROMQL_WORDS
    }
    return metrics, labels


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, expression, legend) of every query in the dashboard, template variables included."""
    dash = json.loads(DASHBOARD.read_text())
    out: list[tuple[str, str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out.append((p.get("title", "?"), t["expr"], t.get("legendFormat", "")))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", q)
            assert m, f"template variable {var['name']}: unexpected query {q!r}"
            out.append((f"variable {var['name']}", m.group(1), "{{" + m.group(2) + "}}"))
    return out


def test_promql_name_extraction() -> None:
    metrics, labels = promql_names(
        "histogram_quantile(0.99, sum by (le, instance) "
        '(rate(ucm_load_duration_ms_bucket{instance=~"$instance"}[5m])))'
        " / on (instance) group_left ucm_sessions > 0"
    )
    assert metrics == {"ucm_load_duration_ms_bucket", "ucm_sessions"}
    assert labels == {"le", "instance"}


def test_dashboard_uses_only_exported_metrics(live: tuple[DaemonProcess, str]) -> None:
    _, text = live
    exported: set[str] = set()
    exported_labels = {"instance", "job"}  # added by Prometheus at scrape time
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.add(sample.name)
            exported_labels |= set(sample.labels)
    queries = dashboard_queries()
    assert len(queries) > 20
    used: set[str] = set()
    for title, expr, legend in queries:
        metrics, labels = promql_names(expr)
        labels |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        assert metrics, f"{title}: no metric in {expr!r}"
        missing = metrics - exported
        assert not missing, f"panel {title!r}: {sorted(missing)} not exported by ucm-server"
        unknown = sorted(labels - exported_labels)
        assert not unknown, f"panel {title!r}: labels {unknown} are on no ucm-server metric"
        used |= metrics
    # The dashboard covers the daemon's main figures.
    for name in (
        "ucm_lookup_hit_rate",
        "ucm_load_duration_ms_bucket",
        "ucm_load_speed_gbps",
        "ucm_save_duration_ms_bucket",
        "ucm_save_speed_gbps",
        "ucm_tier_blocks",
        "ucm_tier_bytes",
        "ucm_tier_capacity_bytes",
        "ucm_tier_evictions_total",
        "ucm_tier_errors_total",
        "ucm_tier_corrupt_total",
        "ucm_task_queue_depth",
        "ucm_writeback_pending",
        "ucm_writeback_bytes_pending",
        "ucm_writeback_skipped_total",
        "ucm_sessions",
        "ucm_rpc_errors_total",
    ):
        assert name in used, f"the dashboard shows nothing of {name}"
