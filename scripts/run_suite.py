"""Run the whole test suite as three concurrent pytest processes: the real-vLLM tests, the SGLang and
container tests, and the rest.

Why: the suite is about half idle on a 2-core machine run serially (daemon starts, tier timeouts,
service waits, image builds), and its slowest third is the real-vLLM tests (fresh engine processes, one
at a time). Two groups side by side took 21 min against 35 min serially; the SGLang tests (a subprocess
in their own venv) and the podman tests (image builds, containers) wait on other processes most of
their time, so they run as a third group instead of lengthening the rest. The vLLM tests stay serial
among themselves, so at most one engine runs at a time.

``make test`` calls this with ``PYTEST_ARGS``. Options pass to every process. Naming tests (a path,
a node id) or a marker expression (``-m``), or ``UCM_TEST_SERIAL=1``, runs one plain pytest instead.
The rest's output streams live; each other group's is written to ``.pytest-<group>.log`` and printed
when all have ended. The exit status is 0 only when every group passed.

Run: ``python scripts/run_suite.py [pytest options]``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GROUPS = {
    "vllm": "vllm",
    "engines": "(sglang or deploy) and not vllm",
    "rest": "not (vllm or sglang or deploy)",
}
"""Each group's marker expression; together they select every test exactly once."""
STREAMED = "rest"
NO_TESTS_COLLECTED = 5
"""pytest's exit status when a group selects nothing (``-k`` matching only the other group)."""


def runs_serially(args: list[str]) -> bool:
    """Whether the caller chose what to run: then the choice is theirs, in one process."""
    if os.environ.get("UCM_TEST_SERIAL") == "1" or "-m" in args:
        return True
    takes_value = {"-k", "-p", "-o", "-c", "--basetemp", "--rootdir", "--durations", "--maxfail", "--timeout"}
    prev = ""
    for arg in args:
        if not arg.startswith("-") and prev not in takes_value:
            return True  # a path or node id
        prev = arg
    return False


def pytest_command(args: list[str], marker: str, cache: str) -> list[str]:
    """One group's pytest; each keeps its own cache (two sessions would overwrite one ``lastfailed``)."""
    own_cache = [] if "no:cacheprovider" in args else ["-o", f"cache_dir={cache}"]
    return [sys.executable, "-m", "pytest", "-m", marker, *own_cache, *args]


def log_path(group: str) -> Path:
    return REPO / f".pytest-{group}.log"


def main(args: list[str]) -> int:
    if runs_serially(args):
        return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=REPO)
    started = time.monotonic()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {group: log_path(group).open("w") for group in GROUPS if group != STREAMED}
    try:
        for group, marker in GROUPS.items():
            out = logs.get(group)
            procs[group] = subprocess.Popen(
                pytest_command(args, marker, f".pytest_cache/{group}"),
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
            )
        codes = {group: proc.wait() for group, proc in procs.items()}
    except KeyboardInterrupt:
        for proc in procs.values():
            proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            proc.wait()
        raise
    finally:
        for log in logs.values():
            log.close()
    for group in logs:
        print(f"\n=============== the {group} tests (.pytest-{group}.log) ===============", flush=True)
        sys.stdout.write(log_path(group).read_text())
    minutes = (time.monotonic() - started) / 60
    statuses = ", ".join(f"{group} {rc}" for group, rc in codes.items())
    print(f"\nrun_suite: {minutes:.1f} min; exit status {statuses}", flush=True)
    if all(rc == NO_TESTS_COLLECTED for rc in codes.values()):
        return NO_TESTS_COLLECTED
    failed = [rc for rc in codes.values() if rc not in (0, NO_TESTS_COLLECTED)]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
