"""deploy/k8s validated and rendered offline: ``kubectl kustomize`` renders the kustomization
with no cluster, ``kubernetes-validate --strict`` checks every rendered object and every file against
the Kubernetes OpenAPI schemas it ships (unknown fields are errors), and a manifest with a typo fails.

No cluster runs here, so the pods are not scheduled: what the daemon does in them is shown by the
image tests (tests/deploy/test_image.py) with the same config path, probes and mounts. Skips, with the
reason, where kubectl or kubernetes-validate is missing (scripts/services/install_podman.sh installs
both).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.deploy  # renders and validates with kubectl: not part of `make test-fast`

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (scripts/services/install_podman.sh installs it)")
    return found


def validate(*paths: Path) -> subprocess.CompletedProcess[str]:
    argv = [tool("kubernetes-validate"), "--strict", "--no-warn", *map(str, paths)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    proc = subprocess.run(
        [tool("kubectl"), "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    out = tmp_path_factory.mktemp("kustomize") / "rendered.yaml"
    out.write_text(proc.stdout)
    return out


def test_kustomize_renders_every_resource(rendered: Path) -> None:
    docs = [d for d in yaml.safe_load_all(rendered.read_text()) if d]
    kinds = sorted((d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]) for d in docs)
    assert kinds == [
        ("ConfigMap", "ucm", "ucm-config"),
        ("DaemonSet", "ucm", "ucm-server"),
        ("Deployment", "vllm", "vllm"),
        ("Namespace", "", "ucm"),
        ("Namespace", "", "vllm"),
    ]


def test_rendered_objects_validate_strictly(rendered: Path) -> None:
    proc = validate(rendered)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = [line for line in proc.stdout.splitlines() if " passed " in line]
    assert len(passed) == 5, proc.stdout


def test_each_manifest_file_validates() -> None:
    files = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    proc = validate(*files)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_typo_fails_validation(tmp_path: Path) -> None:
    """The check can fail: a misspelt field (what an operator's edit may add) is rejected offline."""
    doc = yaml.safe_load((K8S / "daemonset.yaml").read_text())
    doc["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"periodSeconds": 10}
    bad = tmp_path / "daemonset.yaml"
    bad.write_text(yaml.safe_dump(doc))
    proc = validate(bad)
    assert proc.returncode != 0 and "livenesProbe" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
