"""Run the whole test suite as two concurrent pytest processes: the real-vLLM tests and the rest.

Why: the suite is about half idle on a 2-core machine run serially (daemon starts, tier timeouts,
service waits), and its slowest third is the real-vLLM tests (fresh engine processes, one at a time).
Side by side here: 20 min 54 s (vLLM, 57 tests) beside 17 min 09 s (the rest, 1,217) against
35 min serially. The vLLM tests stay serial among themselves, so at most one engine runs at a time.

``make test`` calls this with ``PYTEST_ARGS``. Options pass to both processes. Naming tests (a path,
a node id) or a marker expression (``-m``), or ``UCM_TEST_SERIAL=1``, runs one plain pytest instead.
The rest's output streams live; the vLLM group's is written to ``.pytest-vllm.log`` and printed when it
ends. The exit status is 0 only when both groups passed.

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
VLLM_LOG = REPO / ".pytest-vllm.log"
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


def main(args: list[str]) -> int:
    if runs_serially(args):
        return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=REPO)
    started = time.monotonic()
    with VLLM_LOG.open("w") as log:
        vllm = subprocess.Popen(
            pytest_command(args, "vllm", ".pytest_cache/vllm"), cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
        rest = subprocess.Popen(pytest_command(args, "not vllm", ".pytest_cache/rest"), cwd=REPO)
        try:
            rest_rc = rest.wait()
            vllm_rc = vllm.wait()
        except KeyboardInterrupt:
            for proc in (rest, vllm):
                proc.send_signal(signal.SIGINT)
            for proc in (rest, vllm):
                proc.wait()
            raise
    print(f"\n==================== the real-vLLM tests ({VLLM_LOG.name}) ====================", flush=True)
    sys.stdout.write(VLLM_LOG.read_text())
    codes = {"rest": rest_rc, "vllm": vllm_rc}
    minutes = (time.monotonic() - started) / 60
    print(f"\nrun_suite: {minutes:.1f} min; exit status rest {rest_rc}, vllm {vllm_rc}", flush=True)
    if all(rc == NO_TESTS_COLLECTED for rc in codes.values()):
        return NO_TESTS_COLLECTED
    failed = [rc for rc in codes.values() if rc not in (0, NO_TESTS_COLLECTED)]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
