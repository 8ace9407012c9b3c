"""``ucm-admin`` run as the real command, a subprocess, the way a script runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ucm_server.testing.daemon import DaemonProcess


def run_admin(
    *args: str, env: dict[str, str] | None = None, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ucm_client.admin ARGS`` with no UCM_* variables leaking in but those of ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    return subprocess.run(
        [sys.executable, "-m", "ucm_client.admin", *args],
        check=False,
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        input=stdin,
        timeout=60,
    )


def admin(
    target: DaemonProcess | Path | str, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ucm_client.admin --socket ... ARGS`` with no UCM_* variables leaking in."""
    sock = target.socket if isinstance(target, DaemonProcess) else target
    return run_admin("--socket", str(sock), *args, stdin=stdin if stdin is not None else "")


def json_of(proc: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(proc.stdout)
