"""``ucm-admin`` run as the real command, a subprocess, the way a script runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ucm_server.testing.daemon import DaemonProcess


def admin(
    target: DaemonProcess | Path | str, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ucm_client.admin --socket ... ARGS`` with no UCM_* variables leaking in."""
    sock = target.socket if isinstance(target, DaemonProcess) else target
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    return subprocess.run(
        [sys.executable, "-m", "ucm_client.admin", "--socket", str(sock), *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        input=stdin if stdin is not None else "",
        timeout=60,
    )


def json_of(proc: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(proc.stdout)
