"""The directory helpers' old address, which ``ucm_server.store.posix`` still imports them from.

They live in :mod:`ucm_server.directories`; once the Posix package imports them from there, this
module and the ``ucm_server.api`` package go.
"""

from __future__ import annotations

from ucm_server.directories import fsync_dir, make_private_dirs

__all__ = ["fsync_dir", "make_private_dirs"]
