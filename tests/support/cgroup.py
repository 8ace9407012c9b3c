"""A real memory limit for a process under test: a child memory cgroup (v2, or v1's memory controller).

The tests that show a client cannot make the daemon hold its memory start the daemon inside such a
cgroup, exactly as a container's ``--memory`` limit would, and read the kernel's own figures: peak
usage and OOM kills. :func:`unavailable` says precisely why no cgroup can be made here (not root, no
memory controller, a read-only or undelegated hierarchy) and the tests skip with that reason.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
_names = itertools.count()


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here; the message says what is missing."""


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    version: int

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this cgroup from its first instruction (the shell joins, then execs)."""
        join = f'echo $$ > {shlex.quote(str(self.path / "cgroup.procs"))} && exec "$@"'
        return ["/bin/sh", "-c", join, "sh", *argv]

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def usage(self) -> int:
        return int(self._read("memory.current" if self.version == 2 else "memory.usage_in_bytes"))

    def peak(self) -> int:
        """Highest usage since creation or the last :meth:`reset_peak`."""
        return int(self._read("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"))

    def reset_peak(self) -> bool:
        """Start a new peak (v1 always; v2 from Linux 6.12); whether it could."""
        try:
            (self.path / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")).write_text(
                "0"
            )
        except OSError:
            return False
        return True

    def oom_kills(self) -> int:
        for line in self._read("memory.events" if self.version == 2 else "memory.oom_control").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def processes(self) -> list[int]:
        return [int(p) for p in self._read("cgroup.procs").split()]


def _own_v2() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return ROOT / line[3:].lstrip("/")
    return None


def _own_v1_memory() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        if "memory" in controllers.split(","):
            return ROOT / "memory" / where.lstrip("/")
    return None


def _parent() -> tuple[Path, int]:
    """Where a child cgroup with a memory limit can be made, and the cgroup version."""
    if os.geteuid() != 0:
        raise CgroupUnavailable("making a memory cgroup needs root (CI runs as root)")
    if (ROOT / "cgroup.controllers").exists():  # the unified hierarchy
        if "memory" not in (ROOT / "cgroup.controllers").read_text().split():
            raise CgroupUnavailable("cgroup v2 is mounted without the memory controller")
        own = _own_v2()
        if own is None:
            raise CgroupUnavailable("/proc/self/cgroup names no cgroup v2 path")
        # A process may not sit in a cgroup whose children get controllers: make the child beside
        # this process's cgroup, under its parent, when this one has the memory controller off.
        for parent in (own, own.parent):
            if "memory" in (parent / "cgroup.subtree_control").read_text().split():
                return parent, 2
        raise CgroupUnavailable(
            f"cgroup v2: neither {own} nor its parent delegates the memory controller to children "
            "(cgroup.subtree_control lacks 'memory')"
        )
    own = _own_v1_memory()
    if own is None or not (ROOT / "memory").is_dir():
        raise CgroupUnavailable("no cgroup v2 with memory, and no cgroup v1 memory controller mounted")
    return own, 1


def unavailable() -> str | None:
    """Why no memory cgroup can be made here, or None when one can."""
    try:
        with memory_cgroup(64 << 20):
            return None
    except CgroupUnavailable as exc:
        return str(exc)


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup]:
    """A fresh child cgroup limited to ``limit`` bytes (no swap beyond it where the kernel accounts
    swap); removed afterwards, once the processes started in it are gone."""
    parent, version = _parent()
    path = parent / f"ucm-test-{os.getpid()}-{next(_names)}"
    try:
        path.mkdir()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot make a cgroup under {parent}: {exc.strerror}") from None
    try:
        try:
            if version == 2:
                (path / "memory.max").write_text(str(limit))
                with contextlib.suppress(FileNotFoundError):
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit))
                with contextlib.suppress(OSError):  # only where swap is accounted
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
        except OSError as exc:
            raise CgroupUnavailable(f"cannot set a memory limit on {path}: {exc.strerror}") from None
        yield MemoryCgroup(path, version)
    finally:
        for _ in range(100):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.05)  # its last process is still exiting
