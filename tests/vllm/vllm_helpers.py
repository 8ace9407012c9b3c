"""Helpers for the connector tests: real daemons and fresh vLLM processes (see ``vllm_runner.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ucm_server.testing.daemon import DaemonProcess

RUNNER = Path(__file__).with_name("vllm_runner.py")
REPO = Path(__file__).resolve().parents[2]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def start_daemon(workdir: Path, *args: str, data_dir: Path | None = None) -> DaemonProcess:
    """A real ``ucm-server`` writing through to disk (so every stored block is a file at once)."""
    return DaemonProcess(workdir, args=["--write-mode", "write-through", *args], data_dir=data_dir).start()


def run_vllm(
    workdir: Path,
    spec: dict[str, Any],
    *,
    socket: Path | None,
    env: dict[str, str] | None = None,
    expect_failure: bool = False,
    timeout_s: float = 240,
) -> dict[str, Any]:
    """Run one fresh vLLM process (``vllm_runner.py``) and return its JSON report."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = workdir / "spec.json", workdir / "result.json"
    spec_path.write_text(json.dumps(spec))
    # Nothing from the caller's environment that changes the connector or vLLM's hashing leaks in.
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_") and k != "PYTHONHASHSEED"}
    if socket is not None:
        run_env["UCM_SOCKET"] = str(socket)
    run_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(spec_path), str(result_path)],
        cwd=REPO,
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    (workdir / "log.txt").write_text(proc.stdout)
    if expect_failure:
        if proc.returncode == 0:
            raise AssertionError("the vLLM run was expected to fail but succeeded")
        return {"log": proc.stdout}
    if proc.returncode != 0:
        raise AssertionError(f"vLLM run failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    report: dict[str, Any] = json.loads(result_path.read_text())
    report["log"] = proc.stdout
    return report
