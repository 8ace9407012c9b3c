"""Real podman for the deployment tests: the base images, the ucm-server image, containers.

podman (Debian package) runs here once its runtime is runc and its default ulimits fit the host:
``deploy/image/containers.conf`` says so and every call gets it through ``CONTAINERS_CONF``. No
registry is reachable, so the base images come from ``deploy/image/make-base.sh`` (debootstrap +
``podman import``). Images are tagged by a digest of what went into them and kept in podman's store, so
a second test run on the same machine (or a second test of one run) reuses them instead of
bootstrapping and building again; a changed Dockerfile, source file or constraint makes a new tag.

Where podman cannot run (not installed, not root, no debootstrap) :func:`unavailable` says why and
the tests skip with that reason; ``scripts/services/install_podman.sh`` installs what is needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGE_DIR = ROOT / "deploy" / "image"
CONTAINERS_CONF = IMAGE_DIR / "containers.conf"
MAKE_BASE = IMAGE_DIR / "make-base.sh"
# pip inside a build needs the host's pip settings and CA bundle where the host reaches PyPI through
# a proxy with its own CA (the CI machines do); mounted read-only into the build only, never the image.
PIP_MOUNTS = ("/etc/pip.conf", "/etc/ssl/certs/ca-certificates.crt")
# Build inputs of the ucm-server image: a change in any of them makes a new image tag.
IMAGE_INPUTS = ("Dockerfile", ".dockerignore", "constraints.txt", "pyproject.toml", "README.md")
IMAGE_TREES = ("ucm_server", "ucm_client", "deploy/image")


class PodmanUnavailable(RuntimeError):
    """podman cannot build or run containers here; the message says why (tests skip with it)."""


def env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def unavailable() -> str | None:
    """Why the container tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "podman tests need root (rootful podman, debootstrap, bind mounts owned by uid 10001)"
    for tool in ("podman", "runc", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/services/install_podman.sh installs it)"
    proc = subprocess.run(["podman", "info"], env=env(), capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return f"podman info failed: {proc.stderr.strip()[-500:]}"
    return None


def podman(*args: str, check: bool = True, timeout: float = 120, input: str | None = None) -> str:
    """Run ``podman ARGS``; its stdout. Raises AssertionError with stderr when ``check`` and it fails."""
    proc = subprocess.run(
        ["podman", *args], env=env(), capture_output=True, text=True, timeout=timeout, input=input
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {proc.returncode}: {proc.stderr[-3000:]}")
    return proc.stdout


def podman_rc(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], env=env(), capture_output=True, text=True, timeout=timeout)


def digest(files: Iterable[Path], trees: Iterable[Path] = ()) -> str:
    """A short digest of the files and of every file under the trees (caches and bytecode excluded)."""
    h = hashlib.sha256()
    paths = list(files)
    for tree in trees:
        paths += [p for p in tree.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for path in sorted(paths):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def image_exists(name: str) -> bool:
    return podman_rc("image", "exists", name).returncode == 0


def make_base() -> tuple[str, str]:
    """(build base, runtime base): made by deploy/image/make-base.sh unless podman already holds them."""
    proc = subprocess.run(["bash", str(MAKE_BASE)], env=env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise PodmanUnavailable(f"deploy/image/make-base.sh failed: {proc.stderr.strip()[-1500:]}")
    build, runtime = proc.stdout.split()[-2:]
    return build, runtime


def build_args_for_pip() -> list[str]:
    out: list[str] = []
    for path in PIP_MOUNTS:
        if Path(path).exists():
            out += ["-v", f"{path}:{path}:ro"]
    return out


def build_server_image(bases: tuple[str, str]) -> str:
    """The ucm-server image, built from the repository's Dockerfile the air-gapped way
    docs/operations.md describes: ``bases`` = (build base, runtime base) of make-base.sh, passed as
    the ``BUILD_BASE`` / ``RUNTIME_BASE`` build arguments (no registry is reachable here)."""
    build_base, runtime_base = bases
    tag = digest([ROOT / f for f in IMAGE_INPUTS], [ROOT / t for t in IMAGE_TREES])
    name = f"localhost/ucm-server:test-{tag}"
    if image_exists(name):
        return name
    podman(
        "build",
        "--format",
        "docker",
        "--network",
        "host",
        *build_args_for_pip(),
        "--build-arg",
        f"BUILD_BASE={build_base}",
        "--build-arg",
        f"RUNTIME_BASE={runtime_base}",
        "-t",
        name,
        str(ROOT),
        timeout=900,
    )
    return name


@dataclass
class Container:
    """One running container, removed (with its anonymous volumes) by :meth:`remove`."""

    name: str

    @classmethod
    def run(cls, image: str, args: Sequence[str], command: Sequence[str] = ()) -> Container:
        name = f"ucm-test-{uuid.uuid4().hex[:10]}"
        podman("run", "-d", "--name", name, *args, image, *command, timeout=180)
        return cls(name)

    def exec(self, *argv: str, user: str | None = None, check: bool = True, timeout: float = 120) -> str:
        who = ["--user", user] if user else []
        return podman("exec", *who, self.name, *argv, check=check, timeout=timeout)

    def exec_rc(
        self, *argv: str, user: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        who = ["--user", user] if user else []
        return podman_rc("exec", *who, self.name, *argv, timeout=timeout)

    def inspect(self) -> dict[str, object]:
        data: list[dict[str, object]] = json.loads(podman("inspect", self.name))
        return data[0]

    def state(self) -> dict[str, object]:
        state = self.inspect()["State"]
        assert isinstance(state, dict)
        return state

    def logs(self) -> str:
        proc = podman_rc("logs", self.name)
        return proc.stdout + proc.stderr

    def wait_healthy(self, timeout_s: float = 90) -> None:
        """Run the image's HEALTHCHECK until it passes; AssertionError with the logs if it never does.

        podman schedules health checks through systemd timers, which do not exist here, so the test
        runs them itself (``podman healthcheck run``: the image's own HEALTHCHECK command, as root's
        scheduler would run it) and then reads the status podman recorded.
        """
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            proc = podman_rc("healthcheck", "run", self.name, timeout=60)
            if proc.returncode == 0:
                return
            last = proc.stdout + proc.stderr
            if not self.state().get("Running"):
                break
            time.sleep(1)
        raise AssertionError(
            f"{self.name} never became healthy ({last.strip()}); logs:\n{self.logs()[-4000:]}"
        )

    def health_status(self) -> str:
        state = self.state()
        health = state.get("Health") or state.get("Healthcheck") or {}
        assert isinstance(health, dict)
        return str(health.get("Status", ""))

    def wait_exit(self, timeout_s: float = 60) -> int:
        out = podman("wait", self.name, timeout=timeout_s)
        return int(out.strip().splitlines()[-1])

    def remove(self) -> None:
        podman_rc("rm", "--force", "--volumes", "--time", "5", self.name, timeout=120)


# The daemon's uid in the image (Dockerfile USER), the k8s manifests and the systemd example.
UCM_UID = 10001


@dataclass
class HostDirs:
    """Host directories bind-mounted into a daemon container, as an operator prepares them."""

    root: Path
    run: Path  # -> /run/ucm (the socket directory shared with clients)
    data: Path  # -> /var/lib/ucm (the block store)
    etc: Path  # -> /etc/ucm (the config, read-only)


def make_host_dirs() -> HostDirs:
    """A fresh /run/ucm, /var/lib/ucm and /etc/ucm on the host, owned by the daemon's uid where needed,
    as an operator prepares them. Under /tmp with a 0711 root so a client running as uid 10001 on the
    host can reach the socket. The caller removes ``root``."""
    root = Path(tempfile.mkdtemp(prefix="ucm-deploy-", dir="/tmp"))
    root.chmod(0o711)
    return HostDirs(
        root,
        owned_dir(root / "run", UCM_UID, 0o700),
        owned_dir(root / "data", UCM_UID, 0o700),
        owned_dir(root / "etc", 0, 0o755),
    )


def owned_dir(path: Path, uid: int, mode: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


def client(socket: Path, action: str, seed: str, count: int) -> dict[str, object]:
    """tests/deploy/roundtrip.py run on the host as the daemon's uid, as a vLLM process would be.

    ``setpriv`` (util-linux) drops root to 10001:10001 with no supplementary groups and no capabilities.
    """
    script = ROOT / "tests" / "deploy" / "roundtrip.py"
    drop = ["setpriv", f"--reuid={UCM_UID}", f"--regid={UCM_UID}", "--clear-groups", "--inh-caps=-all"]
    proc = subprocess.run(
        [*drop, sys.executable, str(script), str(socket), action, seed, str(count)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return _summary(proc, action)


def _summary(proc: subprocess.CompletedProcess[str], action: str) -> dict[str, object]:
    assert proc.returncode == 0, f"client {action}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def container_client(
    image: str, mounts: Sequence[str], socket: str, action: str, seed: str, count: int
) -> dict[str, object]:
    """The same client in a second container of ``image`` (its venv has ucm_client), as uid 10001, with
    the daemon's socket directory mounted: the way a vLLM container talks to the daemon container."""
    script = ROOT / "tests" / "deploy" / "roundtrip.py"
    args = ["run", "--rm", "--no-healthcheck", "--network", "none", "--user", f"{UCM_UID}:{UCM_UID}"]
    args += [*mounts, "-v", f"{script}:/roundtrip.py:ro", "--entrypoint", "python3", image]
    proc = podman_rc(*args, "/roundtrip.py", socket, action, seed, str(count), timeout=180)
    return _summary(proc, action)
