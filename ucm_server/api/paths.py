"""Default locations shared by the daemon and its clients, so both agree with no configuration.

``default_socket_path``, ``default_data_dir`` and ``target_for`` moved to :mod:`ucm_protocol.paths` (this
path re-exports them until 0.2); ``make_private_dirs`` is the daemon's own and stays here.
"""

from __future__ import annotations

import os
from pathlib import Path

from ucm_protocol.paths import default_data_dir, default_socket_path, target_for

__all__ = ["default_data_dir", "default_socket_path", "make_private_dirs", "target_for"]


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
