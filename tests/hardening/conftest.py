"""Fixtures of the hardening tests: a real tmpfs for disk-full, and the fuzz case counter's report."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # ``benchmarks`` (the load generator) is importable under plain `pytest` too
    sys.path.insert(0, str(REPO))


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs, so ``ENOSPC`` comes from the kernel, not from a double; unmounted after."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print how many cases each fuzzer ran (and how many hit a known bug), so reports can cite them."""
    from hardening_helpers import FUZZ_COUNTS

    if not FUZZ_COUNTS:
        return
    terminalreporter.section("fuzz cases run")
    for name, count in sorted(FUZZ_COUNTS.items()):
        terminalreporter.write_line(f"{count:6d}  {name}")
    terminalreporter.write_line(f"{FUZZ_COUNTS.total():6d}  total")
