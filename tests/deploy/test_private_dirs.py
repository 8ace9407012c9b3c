"""Every directory the daemon creates for its data, parents
included, is owner-only (0700), whatever the umask lets through.

A real daemon is started on a data directory whose parents do not exist yet, under the permissive
umask 022 that services and containers usually run with; it stores blocks (which makes the namespace
and shard directories, or with packs, the default for small blocks, the pack directories). Before the fix the
parents came out 0755, so any local user could list which models' namespaces a node caches.
No podman needed: this runs everywhere.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.posix_files import stored_blocks

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_server.testing.daemon import DaemonProcess


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)  # inherited by the daemon process
    try:
        yield
    finally:
        os.umask(old)


def open_dirs(top: Path) -> list[str]:
    return [
        f"{d} {stat.S_IMODE(d.stat().st_mode):o}"
        for d in [top, *(Path(p) / n for p, dirs, _ in os.walk(top) for n in dirs)]
        if d.stat().st_mode & 0o077
    ]


@pytest.mark.parametrize("packs", ["0", "65536"], ids=["one file per block", "packs"])
def test_data_dir_and_everything_under_it_is_owner_only(tmp_path: Path, umask_022: None, packs: str) -> None:
    base = tmp_path / "srv"
    base.mkdir(mode=0o755)
    data = base / "deep" / "nested" / "ucm"  # three levels that do not exist yet
    ns = namespace_id(model="private-dirs", dtype="uint8")
    with DaemonProcess(tmp_path / "d", data_dir=data, args=["--posix-pack-max-block-bytes", packs]) as d:
        with UcmClient(d.target) as c, SharedBuffer(1 << 20) as buf:
            region = c.register(buf)
            buf.array()[:] = 7
            blocks = [BlockIO(key_digest("p", i), (Segment(region, i << 16, 1 << 16),)) for i in range(4)]
            assert c.wait(c.dump(ns, blocks), 10).ok
        assert d.healthy()
    created = [base / "deep", base / "deep" / "nested", data]
    for directory in created:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, f"{directory} {directory.stat().st_mode:o}"
    assert stored_blocks(data / "blocks") == 4, "the blocks reached the Posix tier"
    loose = open_dirs(data)
    assert not loose, f"directories open to group/other: {loose}"
