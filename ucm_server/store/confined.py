"""File access confined to a tier's root directories: files on disk are data, never instructions.

A file tier's tree is written by the daemon, but anything can be planted in it: a FIFO where a block
file should be (opening it would block forever), a symlink in place of a namespace directory (writes
would land outside the data directory), a symlink in place of a block file (a read would serve
``/etc/passwd``'s bytes to the checksum check, a quarantine would move it). So below a root:

- directories are walked one component at a time with ``O_NOFOLLOW | O_DIRECTORY`` relative to the
  parent's descriptor (``dir_fd=``): a symlinked component fails the operation with ``ELOOP`` /
  ``ENOTDIR`` instead of being followed;
- files are opened ``O_NOFOLLOW | O_NONBLOCK`` and kept only if ``fstat`` says they are regular
  (:class:`NotRegularFile` otherwise, naming the kind), so neither a FIFO nor a device can hang us;
- a directory created on the way is made durable by fsyncing its parent (only when one was really
  created: walking existing directories costs one ``openat`` per level and no fsync).

The root itself is the operator's choice (it may be a symlink to another disk) and is followed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["NotRegularFile", "file_kind", "open_dir", "open_regular", "parent_dir"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotRegularFile(OSError):
    """Something other than a regular file where a block file should be; ``kind`` says what."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"not a regular file ({kind}), skipped", path)
        self.kind = kind


def file_kind(mode: int) -> str:
    """A short name for a file type (for logs and the ``skipped_files`` counters)."""
    for test, name in (
        (stat.S_ISREG, "regular"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "char-device"),
        (stat.S_ISBLK, "block-device"),
    ):
        if test(mode):
            return name
    return "other"


def open_dir(root: Path, parts: Sequence[str], *, create: bool = False, sync_created: bool = False) -> int:
    """A descriptor of ``root/parts...`` that followed no symlink below ``root``.

    ``create`` makes missing directories (mode 0700); ``sync_created`` then fsyncs the parent of each
    one made, so the new entry survives a power loss. A symlink or non-directory on the way raises
    ``OSError`` naming the component. The caller closes the descriptor.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        where = root
        for part in parts:
            if part in ("", ".", "..") or "/" in part:
                raise OSError(errno.EINVAL, "path component not allowed", str(where / part))
            where = where / part
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):  # a concurrent writer made it first
                    os.mkdir(part, 0o700, dir_fd=fd)
                    if sync_created:
                        os.fsync(fd)
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(
                        exc.errno, "refusing to follow a symlink or non-directory", str(where)
                    ) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def parent_dir(root: Path, path: Path, *, create: bool = False, sync_created: bool = False) -> Iterator[int]:
    """:func:`open_dir` of ``path``'s directory (``path`` below ``root``), closed on exit."""
    parts = path.relative_to(root).parts[:-1]
    fd = open_dir(root, parts, create=create, sync_created=sync_created)
    try:
        yield fd
    finally:
        os.close(fd)


def open_regular(name: str, flags: int, *, dir_fd: int, mode: int = 0o600, shown: str = "") -> int:
    """Open ``name`` in ``dir_fd`` only if it is a regular file, without following a symlink.

    ``O_NONBLOCK`` makes opening a FIFO return at once; it is cleared again once ``fstat`` showed a
    regular file. Raises :class:`NotRegularFile` (an ``OSError``) for anything else.
    """
    try:
        fd = os.open(
            name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, mode, dir_fd=dir_fd
        )
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(shown or name, "symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(shown or name, file_kind(st.st_mode))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd
