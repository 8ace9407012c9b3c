"""Reading the deployment artifacts (Dockerfile, deploy/k8s, deploy/systemd, deploy/grafana) as data.

The parsers and paths the static artifact checks (``tests/deploy/test_artifacts.py``) and the checks
against a real daemon (``tests/deploy/test_artifacts_live.py``) share.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from ucm_client.vllm import config as connector_config
from ucm_server.server import Daemon

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
UNIT = DEPLOY / "systemd" / "ucm-server.service"
UNIT_CONFIG = DEPLOY / "systemd" / "ucm.yaml"
IMAGE_CONFIG = DEPLOY / "image" / "ucm.yaml"
IMAGE_CONFIG_PATH = "/etc/ucm/ucm.yaml"  # where the Dockerfile puts it and the ConfigMap is mounted
DASHBOARD = DEPLOY / "grafana" / "ucm-dashboard.json"

# The daemon's runtime dependencies (pyproject [project].dependencies): what `pip install .` in the
# image pulls. torch, vllm and cupy belong to the client-side extras only.
DAEMON_DEPENDENCIES = {
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "uvloop",
    "pyyaml",
    "prometheus-client",
    "xxhash",
    "rich",
    "numpy",
    "pyzmq",  # KV events
    "opentelemetry-api",  # tracing (off by default; imported only when on)
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-http",
    "msgpack",
    "cryptography",  # encryption at rest
}
CLIENT_ONLY = ("torch", "vllm", "cupy")

# UCM_* variables a client process (vLLM + connector, ucm-admin) reads.
CONNECTOR_ENV = {f"UCM_{f.name.upper()}" for f in dataclasses.fields(connector_config.ConnectorConfig)}
CLIENT_ENV = CONNECTOR_ENV | {
    "UCM_SOCKET",
    "UCM_TARGET",
    "UCM_TOKEN",
    "UCM_CONFIG_FILE",
    "UCM_SERVER_CONFIG",
    "UCM_SPARSE_CONFIG",
    "UCM_LOG_LEVEL",
    "UCM_ADMIN_DEBUG",
}
SHUTDOWN_GRACE_S: float = inspect.signature(Daemon.shutdown).parameters["grace_s"].default


# -- parsers ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Instruction:
    name: str
    args: str


def parse_dockerfile(text: str) -> list[list[Instruction]]:
    """Instructions per build stage (the first list holds ARGs before the first FROM)."""
    logical: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue  # comments (also inside continuations), parser directives, blank lines
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current.strip(), "Dockerfile ends inside a line continuation"
    stages: list[list[Instruction]] = [[]]
    for line in logical:
        name, _, args = line.partition(" ")
        ins = Instruction(name.upper(), args.strip())
        if ins.name == "FROM":
            stages.append([])
        stages[-1].append(ins)
    return stages


def exec_form(args: str) -> list[str]:
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def parse_env(args: str) -> dict[str, str]:
    words = shlex.split(args)
    if "=" not in words[0]:  # legacy "ENV KEY value"
        return {words[0]: args.split(None, 1)[1]}
    return dict(w.split("=", 1) for w in words)


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values in order]}} (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    section: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
            continue
        assert section is not None, f"{UNIT.name}: {line!r} outside a section"
        key, _, value = line.partition("=")
        section.setdefault(key.strip(), []).append(value.strip())
    return sections


def quantity_bytes(text: str | int) -> int:
    """A Kubernetes memory quantity ("20Gi", "512M", 1024) in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTP]i?)?", str(text))
    assert m, f"not a memory quantity: {text!r}"
    unit = m.group(2) or ""
    base = 1024 if unit.endswith("i") else 1000
    power = " KMGTP".index(unit[:1] or " ")
    return int(float(m.group(1)) * base**power)


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


# -- the artifacts ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Image:
    stages: list[list[Instruction]]
    args: dict[str, str]

    @property
    def final(self) -> list[Instruction]:
        return self.stages[-1]

    def all(self, name: str, stage: list[Instruction] | None = None) -> list[Instruction]:
        return [i for i in (self.final if stage is None else stage) if i.name == name]

    def one(self, name: str) -> Instruction:
        found = self.all(name)
        assert len(found) == 1, f"Dockerfile: expected one {name} in the final stage, found {len(found)}"
        return found[0]

    @property
    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for ins in self.all("ENV"):
            out.update(parse_env(ins.args))
        return out

    @property
    def uid(self) -> int:
        user = self.one("USER").args.split(":")[0]
        assert user.isdigit(), "USER should be numeric so Kubernetes' runAsNonRoot can verify it"
        return int(user)

    def expand(self, text: str) -> str:
        """``text`` with ``$X`` / ``${X}`` replaced by ARG defaults (which may name earlier ARGs) or ENV."""
        for _ in range(10):
            expanded = re.sub(
                r"\$\{?(\w+)\}?", lambda m: self.args.get(m.group(1), self.env.get(m.group(1), "")), text
            )
            if expanded == text:
                return text
            text = expanded
        raise AssertionError(f"Dockerfile: {text!r} does not settle (ARGs naming each other?)")


def read_image() -> Image:
    """The Dockerfile's build stages, with the ARG defaults declared before its first FROM."""
    stages = parse_dockerfile((ROOT / "Dockerfile").read_text())
    args: dict[str, str] = {}
    for ins in stages[0]:
        if ins.name == "ARG" and "=" in ins.args:
            key, _, value = ins.args.partition("=")
            args[key] = value
    return Image(stages[1:], args)


def read_manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """Every Kubernetes object under deploy/k8s, by (kind, name)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            assert {"apiVersion", "kind"} <= doc.keys(), f"{path.name}: not a Kubernetes object"
            if doc["kind"] != "Kustomization":
                assert doc.get("metadata", {}).get("name"), f"{path.name}: {doc['kind']} without a name"
            key = (doc["kind"], doc.get("metadata", {}).get("name", ""))
            assert key not in out, f"{path.name}: {key} defined twice"
            out[key] = doc
    return out


def pod_spec(manifests: dict[tuple[str, str], dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = manifests[(kind, name)]["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"no single container {name!r}"
    return found[0]


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in c.get("env", []) if "value" in e}


def mounts(spec: dict[str, Any], c: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """mountPath -> (volumeMount, volume)."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in c.get("volumeMounts", [])}
