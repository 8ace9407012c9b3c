"""The deployment artifacts (Dockerfile, deploy/k8s, deploy/systemd), read statically.

The image, the unit and the manifests are also run for real (tests/deploy/test_image.py,
test_systemd.py, test_manifests.py); these checks need no podman and run everywhere: every manifest
parses; every configuration it carries loads with the daemon's own ``load_config``; no artifact sets a
``UCM_*`` variable that would override its config file; socket path, data directory, metrics port, uid
and config path agree across all of them; and ``systemd-analyze verify`` accepts the unit where it is
installed. The checks against a real daemon are in ``test_artifacts_live.py``.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from support.deploy_artifacts import (
    CLIENT_ENV,
    CLIENT_ONLY,
    DAEMON_DEPENDENCIES,
    IMAGE_CONFIG,
    IMAGE_CONFIG_PATH,
    K8S,
    ROOT,
    SHUTDOWN_GRACE_S,
    UNIT,
    UNIT_CONFIG,
    Image,
    Instruction,
    container,
    env_of,
    exec_form,
    mounts,
    parse_env,
    parse_unit,
    pod_spec,
    port_of,
    quantity_bytes,
)

from ucm_client.vllm import config as connector_config
from ucm_server.config import ServerConfig
from ucm_server.config_sources import load_config, read_env


@pytest.fixture(scope="module")
def configmap_yaml(
    manifests: dict[tuple[str, str], dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    path = tmp_path_factory.mktemp("configmap") / "ucm.yaml"
    path.write_text(manifests[("ConfigMap", "ucm-config")]["data"]["ucm.yaml"])
    return path


@pytest.fixture(scope="module")
def daemonset_config(configmap_yaml: Path) -> ServerConfig:
    config, warnings = load_config(configmap_yaml, environ={})
    assert not warnings
    return config


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


# -- Dockerfile ---------------------------------------------------------------------------------------
def self_and(stage: list[Instruction], name: str) -> list[Instruction]:
    return [i for i in stage if i.name == name]


def test_dockerfile_builds_the_daemon_image(image: Image) -> None:
    # No parser directive that makes BuildKit pull a frontend image (air-gapped builds).
    first = (ROOT / "Dockerfile").read_text().splitlines()[0]
    assert not re.match(r"#\s*syntax\s*=", first, re.IGNORECASE), first
    runs = " ".join(i.args for stage in image.stages for i in self_and(stage, "RUN"))
    installs = re.findall(r"pip install ([^&;|]+)", runs)
    assert installs, "no pip install in the Dockerfile"
    for cmd in installs:
        assert "[" not in cmd, f"pip install {cmd}: the daemon image installs no extras"
        assert not any(name in cmd for name in CLIENT_ONLY), f"pip install {cmd}: client-only packages"
    # The versions are pinned (PIP_CONSTRAINT reaches pip's isolated build environment too).
    build_env: dict[str, str] = {}
    for ins in self_and(image.stages[0], "ENV"):
        build_env.update(parse_env(ins.args))
    assert build_env.get("PIP_CONSTRAINT", "").endswith("constraints.txt")
    assert "uninstall --yes pip setuptools" in runs, "pip and setuptools must leave the runtime venv"
    # The daemon reads its config file from UCM_SERVER_CONFIG, as ucm-admin does: one place names it.
    assert exec_form(image.one("ENTRYPOINT").args) == ["ucm-server"]
    assert image.env["UCM_SERVER_CONFIG"] == IMAGE_CONFIG_PATH
    assert image.one("STOPSIGNAL").args == "SIGTERM"
    assert image.uid != 0, "the daemon must not run as root"
    assert image.one("USER").args.split(":")[0] not in ("root", "0")


PINNED_PUBLIC_BASE = re.compile(r"(docker\.io/)?(library/)?(python|debian):[\w.-]+@sha256:[0-9a-f]{64}")


def test_dockerfile_builds_from_a_pinned_public_base_by_default(image: Image) -> None:
    """A plain `docker build .` works from an official image pinned by digest; the air-gapped bases of
    deploy/image/make-base.sh are build arguments (the podman tests build that way)."""
    bases = [image.expand(stage[0].args.split()[0]) for stage in image.stages]
    for base in bases:
        assert PINNED_PUBLIC_BASE.fullmatch(base), f"FROM {base}: not an official image pinned by digest"
    assert len(set(bases)) == 1, "both stages need the same Python at the same path (the venv points at it)"
    froms = [stage[0].args.split()[0] for stage in image.stages]
    assert froms == ["${BUILD_BASE}", "${RUNTIME_BASE}"], froms
    readme = (ROOT / "README.md").read_text() + (ROOT / "docs" / "operations.md").read_text()
    assert "BUILD_BASE=localhost/ucm-base-build:" in readme and "RUNTIME_BASE=localhost/ucm-base:" in readme


def test_dockerfile_sets_no_ucm_setting_and_bakes_its_config(image: Image) -> None:
    """Environment beats the file in ucm-server, so a setting's ENV in the image would override a
    mounted config. The one UCM_* variable names the file itself (for ucm-server and ucm-admin)."""
    ucm_env = {k: v for k, v in image.env.items() if k.startswith("UCM_")}
    assert ucm_env == {"UCM_SERVER_CONFIG": IMAGE_CONFIG_PATH}, ucm_env
    assert read_env(ucm_env) == ({}, []), "UCM_SERVER_CONFIG must be no setting (nor an unknown one)"
    copies = [exec_form(i.args) for i in image.all("COPY")]
    assert ["deploy/image/ucm.yaml", IMAGE_CONFIG_PATH] in copies
    config, warnings = load_config(IMAGE_CONFIG, environ={})
    assert not warnings
    host, port = config.metrics_address.rsplit(":", 1)
    assert host == "0.0.0.0", "in a container the metrics endpoint must listen beyond loopback"
    assert str(port) in image.one("EXPOSE").args.split()
    volumes = exec_form(image.one("VOLUME").args)
    assert str(config.socket.parent) in volumes and str(config.data_dir) in volumes


def test_dockerfile_healthcheck_reads_the_daemon_config(image: Image) -> None:
    options, _, command = image.one("HEALTHCHECK").args.partition("CMD ")
    words = shlex.split(command.split("||")[0])
    assert words[0] == "ucm-admin" and words[-1] == "health", words
    # no flag: UCM_SERVER_CONFIG names the daemon's config, exactly as `docker exec ... ucm-admin` finds it
    assert "--config" not in words and "--socket" not in words and "--target" not in words
    assert image.env["UCM_SERVER_CONFIG"] == IMAGE_CONFIG_PATH
    assert "|| exit 1" in command, "Docker health checks define only exit codes 0 and 1"
    opts = dict(o.lstrip("-").split("=") for o in options.split())
    assert {"interval", "timeout", "start-period", "retries"} <= opts.keys()


def test_constraints_pin_every_daemon_dependency() -> None:
    """``constraints.txt`` pins each runtime dependency of the package, and pins it exactly."""
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version.strip(), f"constraints.txt: {line!r} is not an exact pin"
            pins[name.strip().lower()] = version.strip()
    assert pins.keys() >= DAEMON_DEPENDENCIES, DAEMON_DEPENDENCIES - pins.keys()
    assert "setuptools" in pins, "the build backend is pinned too"


def test_dockerfile_copies_what_the_build_needs(image: Image) -> None:
    """COPY sources exist in the repository, .dockerignore keeps them, and setuptools gets its readme."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        verdict = False
        parts = PurePosixPath(path).parts
        for pattern in patterns:
            negate = pattern.startswith("!")
            pat = pattern.lstrip("!").rstrip("/").removeprefix("**/")
            prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
            if any(fnmatch(p, pat) or fnmatch(PurePosixPath(p).name, pat) for p in prefixes):
                verdict = not negate
        return verdict

    copied: list[str] = []
    for stage in image.stages:
        for ins in self_and(stage, "COPY"):
            words = exec_form(ins.args)
            if any(w.startswith("--from") for w in words):
                continue
            copied.extend(words[:-1])
    needed = {"pyproject.toml", "README.md", "constraints.txt", "ucm_protocol", "ucm_server", "ucm_client"}
    assert needed <= set(copied)
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        assert not ignored(src), f"COPY {src}: excluded by .dockerignore"
        if (ROOT / src).is_dir():
            assert not ignored(f"{src}/__init__.py")
    assert ignored(".venv/bin/python") and ignored(".git/HEAD") and ignored("ucm_server/__pycache__/x.pyc")


def test_package_depends_only_on_daemon_libraries() -> None:
    """`pip install .` in the image pulls no torch/vllm/cupy: the base requirements are the daemon's."""
    requires = importlib.metadata.requires("ucm") or []
    base = {re.split(r"[<>=!~; \[]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r}
    assert base <= DAEMON_DEPENDENCIES, f"unexpected base dependencies: {base - DAEMON_DEPENDENCIES}"


# -- Kubernetes ---------------------------------------------------------------------------------------
def test_k8s_manifests_parse_and_are_complete(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    kinds = {k for k, _ in manifests}
    assert {"Namespace", "ConfigMap", "DaemonSet", "Deployment", "Kustomization"} <= kinds
    kustomization = manifests[("Kustomization", "")]
    for resource in kustomization["resources"]:
        assert (K8S / resource).exists(), f"kustomization.yaml: {resource} missing"
    listed = {(K8S / r).name for r in kustomization["resources"]} | {"kustomization.yaml"}
    assert {p.name for p in K8S.glob("*.yaml")} == listed
    for (kind, name), doc in manifests.items():
        if kind not in ("Namespace", "Kustomization"):
            namespaces = {n for k, n in manifests if k == "Namespace"}
            assert doc["metadata"].get("namespace") in namespaces, f"{kind}/{name}: namespace"
        if kind in ("DaemonSet", "Deployment"):
            selector = doc["spec"]["selector"]["matchLabels"]
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items(), f"{kind}/{name}: selector does not match its pods"


def test_kustomize_builds_the_same_objects(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    """`kubectl kustomize deploy/k8s` (offline, no cluster) renders exactly the objects of the files."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: kustomization.yaml checked statically only")
    proc = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rendered = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(proc.stdout) if d}
    assert rendered == {key for key in manifests if key[0] != "Kustomization"}


def test_configmap_config_loads(
    configmap_yaml: Path, image: Image, manifests: dict[tuple[str, str], dict[str, Any]]
) -> None:
    _, warnings = load_config(configmap_yaml, environ={})
    assert not warnings
    # Nothing in the pod beats the ConfigMap: no UCM_* setting (image or DaemonSet), no setting
    # flags; the image's UCM_SERVER_CONFIG names the file the DaemonSet's --config does.
    c = container(pod_spec(manifests, "DaemonSet", "ucm-server"), "ucm-server")
    env = {k: v for k, v in {**image.env, **env_of(c)}.items() if k.startswith("UCM_")}
    assert set(env) == {"UCM_SERVER_CONFIG"} and read_env(env) == ({}, []), env
    words = [*c.get("command", []), *c.get("args", [])]
    flags = [w for w in words if w.startswith("--") and w != "--config"]
    assert not flags, f"DaemonSet: settings flags {flags} override the ConfigMap"
    assert words[words.index("--config") + 1] == env["UCM_SERVER_CONFIG"]


def test_daemonset_runs_the_configured_daemon(
    manifests: dict[tuple[str, str], dict[str, Any]], daemonset_config: ServerConfig, image: Image
) -> None:
    spec = pod_spec(manifests, "DaemonSet", "ucm-server")
    c = container(spec, "ucm-server")
    cfg = daemonset_config
    # --config names the mounted ConfigMap key.
    args = [*c.get("command", exec_form(image.one("ENTRYPOINT").args)), *c.get("args", [])]
    config_path = PurePosixPath(args[args.index("--config") + 1])
    _, volume = mounts(spec, c)[str(config_path.parent)]
    assert volume["configMap"]["name"] == "ucm-config"
    items = {i["path"]: i["key"] for i in volume["configMap"].get("items", [])}
    assert items.get(config_path.name, config_path.name) in manifests[("ConfigMap", "ucm-config")]["data"]
    # Socket directory and data directory: host directories at the same path in the pod. No host
    # /dev/shm and no hostIPC: clients hand their memory over as file descriptors.
    m = mounts(spec, c)
    assert "/dev/shm" not in m and not spec.get("hostIPC")
    for path in (str(cfg.socket.parent), str(cfg.data_dir)):
        assert path in m, f"DaemonSet: nothing mounted at {path}"
        assert m[path][1]["hostPath"]["path"] == path and not m[path][0].get("readOnly")
    # Every UCM_* variable is a daemon setting.
    _, unknown = read_env({k: v for k, v in env_of(c).items() if k.startswith("UCM_")})
    assert not unknown
    # Probes run the health command against the configured socket.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[0] == "ucm-admin" and cmd[-1] == "health"
        assert cmd[cmd.index("--config") + 1] == str(config_path), "probes read the daemon's config"
        assert c[probe]["timeoutSeconds"] > float(cmd[cmd.index("--timeout") + 1])
    # Metrics: annotations, container port, config.
    port = port_of(cfg.metrics_address)
    annotations = manifests[("DaemonSet", "ucm-server")]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert port in [p["containerPort"] for p in c["ports"]]
    # Runs as the image's non-root uid; memory limit above the Cache; time to shut down cleanly.
    assert spec["securityContext"]["runAsUser"] == image.uid and spec["securityContext"]["runAsNonRoot"]
    limit = quantity_bytes(c["resources"]["limits"]["memory"])
    assert limit >= cfg.cache_capacity * 1.1, "memory limit leaves no room beside cache_capacity"
    assert spec["terminationGracePeriodSeconds"] > SHUTDOWN_GRACE_S * 2
    for init in spec.get("initContainers", []):  # chowns the host directories for that uid
        script = " ".join(init["command"])
        assert f"{image.uid}:{image.uid}" in script
        assert str(cfg.socket.parent) in script and str(cfg.data_dir) in script


def test_vllm_deployment_uses_the_connector_and_the_daemon_socket(
    manifests: dict[tuple[str, str], dict[str, Any]], daemonset_config: ServerConfig, image: Image
) -> None:
    spec = pod_spec(manifests, "Deployment", "vllm")
    c = container(spec, "vllm")
    words = [*c.get("command", []), *c["args"]]
    raw = words[words.index("--kv-transfer-config") + 1]
    transfer = json.loads(raw)
    assert transfer == {
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm_client.vllm.connector",
        "kv_role": "kv_both",
    }
    env = env_of(c)
    unknown = {k for k in env if k.startswith("UCM_")} - CLIENT_ENV
    assert not unknown, f"vLLM env: not client settings: {unknown}"
    cfg = connector_config.load_config(transfer.get("kv_connector_extra_config"), environ=env)
    assert cfg.target == str(daemonset_config.socket) == env["UCM_SOCKET"]
    # The socket directory is the DaemonSet's host directory, and the only host thing vLLM shares with
    # the daemon: no host /dev/shm, no hostIPC (memory goes over the socket as file descriptors).
    m = mounts(spec, c)
    sock_dir = str(daemonset_config.socket.parent)
    assert m[sock_dir][1]["hostPath"]["path"] == sock_dir
    host_paths = [v["hostPath"]["path"] for _, v in m.values() if "hostPath" in v]
    assert host_paths == [sock_dir], host_paths
    assert not spec.get("hostIPC")
    # Same uid as the daemon: it maps only shared memory owned by its own uid; the socket is 0600.
    assert spec["securityContext"]["runAsUser"] == image.uid


# -- systemd ------------------------------------------------------------------------------------------
def test_daemon_namespace_holds_only_the_daemon(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    """The privileged namespace "ucm" holds ucm-server's objects only; vLLM lives elsewhere,
    in a namespace of its own that namespace.yaml creates, and runs there unprivileged."""
    namespaces = {name: doc for (kind, name), doc in manifests.items() if kind == "Namespace"}
    in_ucm = {key for key, doc in manifests.items() if doc.get("metadata", {}).get("namespace") == "ucm"}
    assert in_ucm == {("ConfigMap", "ucm-config"), ("DaemonSet", "ucm-server")}, in_ucm
    vllm = manifests[("Deployment", "vllm")]
    assert vllm["metadata"]["namespace"] in namespaces.keys() - {"ucm"}
    spec = vllm["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] and not spec.get("hostIPC") and not spec.get("hostNetwork")
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert not sc.get("privileged") and not sc["capabilities"].get("add")


def test_systemd_example_config_loads() -> None:
    config, warnings = load_config(UNIT_CONFIG, environ={})
    assert not warnings
    assert config.store_pipeline.startswith("Cache")


def test_systemd_unit(unit: dict[str, dict[str, list[str]]]) -> None:
    svc = {k: v[-1] for k, v in unit["Service"].items()}
    config, _ = load_config(UNIT_CONFIG, environ={})
    # ExecStart runs ucm-server with the example config's installed path.
    words = shlex.split(svc["ExecStart"])
    # An absolute path, so the journal tags lines with SyslogIdentifier, not "env".
    assert words[0] == "/opt/ucm/bin/ucm-server", words
    assert svc["SyslogIdentifier"] == "ucm-server"
    assert svc["User"] == "ucm" and "--uid 10001" in UNIT.read_text(), "the uid choice is written down"
    config_path = PurePosixPath(words[words.index("--config") + 1])
    assert config_path == PurePosixPath("/etc") / svc["ConfigurationDirectory"] / UNIT_CONFIG.name
    # RuntimeDirectory= holds the socket, StateDirectory= is the data dir, both writable.
    assert config.socket.parent == Path("/run") / svc["RuntimeDirectory"]
    assert config.data_dir == Path("/var/lib") / svc["StateDirectory"]
    rw = " ".join(unit["Service"].get("ReadWritePaths", [])).split()
    for root in [config.data_dir, *config.posix_roots]:
        assert any(root.is_relative_to(p.lstrip("-")) for p in rw), f"{root} not in ReadWritePaths"
    assert svc["User"] not in ("root", "0")
    assert svc["Restart"] == "on-failure"
    assert svc["RestartPreventExitStatus"] == "2"  # ucm-server's configuration-error exit status
    assert svc["KillSignal"] == "SIGTERM"
    assert float(svc["TimeoutStopSec"].rstrip("s")) > SHUTDOWN_GRACE_S * 2
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert svc[key] == "yes", key
    assert svc["ProtectSystem"] == "strict"
    assert svc.get("MemoryDenyWriteExecute", "no") == "no"
    assert svc["RemoveIPC"] == "no", "RemoveIPC would delete the shared memory of vLLM (same user)"
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt package systemd): unit checked statically only")
    copy = tmp_path / UNIT.name  # verify also loads units named like it in the unit's directory
    # verify wants ExecStart's program to exist; here it is a stand-in (test_systemd.py runs the real one).
    program = tmp_path / "ucm-server"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    copy.write_text(UNIT.read_text().replace("ExecStart=/opt/ucm/bin/ucm-server", f"ExecStart={program}"))
    proc = subprocess.run([tool, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=30)
    complaints = [line for line in (proc.stdout + proc.stderr).splitlines() if UNIT.name in line]
    assert proc.returncode == 0 and not complaints, proc.stdout + proc.stderr


# -- paths and ports, all together --------------------------------------------------------------------
def test_socket_and_metrics_port_agree_everywhere(
    image: Image,
    manifests: dict[tuple[str, str], dict[str, Any]],
    daemonset_config: ServerConfig,
    unit: dict[str, dict[str, list[str]]],
) -> None:
    systemd_config, _ = load_config(UNIT_CONFIG, environ={})
    image_config, _ = load_config(IMAGE_CONFIG, environ={})
    vllm = container(pod_spec(manifests, "Deployment", "vllm"), "vllm")
    sockets = {
        "image ucm.yaml": str(image_config.socket),
        "ConfigMap": str(daemonset_config.socket),
        "vLLM Deployment env": env_of(vllm)["UCM_SOCKET"],
        "systemd ucm.yaml": str(systemd_config.socket),
        "systemd RuntimeDirectory": f"/run/{unit['Service']['RuntimeDirectory'][-1]}/ucm.sock",
    }
    assert len(set(sockets.values())) == 1, sockets
    data_dirs = {
        "image ucm.yaml": str(image_config.data_dir),
        "ConfigMap": str(daemonset_config.data_dir),
        "systemd ucm.yaml": str(systemd_config.data_dir),
    }
    assert len(set(data_dirs.values())) == 1, data_dirs
    ports = {
        "image ucm.yaml": port_of(image_config.metrics_address),
        "Dockerfile EXPOSE": int(image.one("EXPOSE").args.split()[0].split("/")[0]),
        "ConfigMap": port_of(daemonset_config.metrics_address),
        "systemd ucm.yaml": port_of(systemd_config.metrics_address),
    }
    assert len(set(ports.values())) == 1, ports
