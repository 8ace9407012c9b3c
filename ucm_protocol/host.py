"""Facts about the host both ends check a size against: the memory a process could still allocate.

Memory that is asked for up front (a client's :class:`~ucm_client.SharedBuffer`, the daemon's Cache
arena, faulted in at start-up) and is larger than what is left is not refused by the kernel: pages are
handed out until its OOM killer ends this process or another one on the host. So both check first.
"""

from __future__ import annotations

from pathlib import Path


def available_memory() -> int | None:
    """Bytes this process could still allocate: the system's ``MemAvailable`` plus free swap, and no
    more than its cgroup has left below its limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes`` as
    a container sees it); None where none of it can be read."""
    figures: list[int] = []
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        figures.append((int(meminfo["MemAvailable"].split()[0]) + int(meminfo["SwapFree"].split()[0])) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    try:
        group = Path("/proc/self/cgroup").read_text().split("0::", 1)[1].split("\n", 1)[0]
        where = Path("/sys/fs/cgroup") / group.lstrip("/")
        limit = (where / "memory.max").read_text().strip()
        if limit != "max":
            used = int((where / "memory.current").read_text()) - _stat(where / "memory.stat", "inactive_file")
            figures.append(int(limit) - used)
    except (OSError, IndexError, ValueError):
        pass
    try:
        v1 = Path("/sys/fs/cgroup/memory")
        limit_v1 = int((v1 / "memory.limit_in_bytes").read_text())
        if limit_v1 < 1 << 62:  # "no limit" is a page-rounded 2**63
            used = int((v1 / "memory.usage_in_bytes").read_text()) - _stat(
                v1 / "memory.stat", "total_inactive_file"
            )
            figures.append(limit_v1 - used)
    except (OSError, ValueError):
        pass
    return min(figures) if figures else None


def _stat(path: Path, name: str) -> int:
    """One figure of a cgroup's ``memory.stat`` (0 if absent). The usage figures count page cache,
    which the kernel reclaims before it fails an allocation: its inactive part is subtracted, as the
    kubelet's working set does, so a container whose Posix tier filled the page cache is not refused."""
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return 0
