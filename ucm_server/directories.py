"""Directories the daemon makes: owner-only when it creates them, and durable when it says so.

The daemon's socket directory, its data directory and every tier root are made with
:func:`make_private_dirs`; :func:`fsync_dir` makes a new or renamed entry of a directory survive power
loss (the journal's and the index snapshots' renames).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "make_private_dirs"]


def make_private_dirs(path: Path) -> None:
    """``mkdir -p path`` where every directory it creates, parents included, is owner-only (0700).

    ``Path.mkdir(parents=True, mode=0o700)`` applies the mode to the last directory only and gives the
    parents the umask's (0755 usually), so other users could list a data directory's namespaces.
    Existing directories are left as they are (an operator may have chosen their mode).
    """
    try:
        path.mkdir(mode=0o700)
    except FileNotFoundError:
        make_private_dirs(path.parent)
        path.mkdir(mode=0o700, exist_ok=True)
    except FileExistsError:
        if not path.is_dir():
            raise


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (a new or renamed file in it survives power loss)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
