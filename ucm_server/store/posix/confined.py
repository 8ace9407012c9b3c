"""File access confined to a tier's root directories: files on disk are data, never instructions.

A file tier's tree is written by the daemon, but anything can be planted in it: a FIFO where a block
file should be (opening it would block forever), a symlink in place of a namespace directory (writes
would land outside the data directory), a symlink in place of a block file (a read would serve
``/etc/passwd``'s bytes to the checksum check, a quarantine would move it). So below a root:

- no symlink is followed: a symlinked component fails the operation (``ELOOP`` / ``ENOTDIR``) instead;
- files are opened ``O_NOFOLLOW | O_NONBLOCK`` and kept only if ``fstat`` says they are regular
  (:class:`NotRegularFile` otherwise, naming the kind), so neither a FIFO nor a device can hang us
  (``O_NONBLOCK`` has no effect on a regular file's reads and writes, so it is not cleared);
- a directory created on the way is made durable by fsyncing its parent (only when one was really
  created: opening existing directories costs no fsync).

Where the kernel has ``openat2`` (Linux 5.6+), a path below the root is resolved in one call with
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` (a block read then costs two opens, not five: this is on
the data path); elsewhere, and to create directories, the components are walked one at a time with
``O_NOFOLLOW | O_DIRECTORY`` relative to the parent's descriptor. Both refuse the same things.

The root itself is the operator's choice (it may be a symlink to another disk) and is followed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ucm_server.api.paths import make_private_dirs

__all__ = [
    "DirCache",
    "NotRegularFile",
    "file_kind",
    "open_block",
    "open_block_sized",
    "open_dir",
    "open_regular",
    "open_regular_sized",
    "parent_dir",
]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_SYS_OPENAT2 = 437  # the same number on every Linux architecture (a "generic" syscall)
_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x02, 0x04, 0x08
_REFUSED = (errno.ELOOP, errno.ENOTDIR, errno.EXDEV)
"""What resolving below a root says when a component is a symlink, not a directory, or escapes."""


class NotRegularFile(OSError):
    """Something other than a regular file where a block file should be; ``kind`` says what."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"not a regular file ({kind}), skipped", path)
        self.kind = kind


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


def _find_openat2() -> Callable[..., int] | None:
    """libc's ``syscall`` if ``openat2`` works here (kernel >= 5.6, not filtered), else None."""
    try:
        syscall: Callable[..., int] = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    how = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE_BENEATH)
    fd = syscall(_SYS_OPENAT2, -100, b".", ctypes.byref(how), ctypes.sizeof(how))  # -100: AT_FDCWD
    if fd < 0:
        return None
    os.close(fd)
    return syscall


_syscall = _find_openat2()
_HOWS: dict[tuple[int, int], _OpenHow] = {}
_HOW_SIZE = ctypes.sizeof(_OpenHow)


def _openat2(dir_fd: int, rel: str, flags: int, mode: int = 0) -> int:
    """``openat2`` below ``dir_fd``: no symlink anywhere in ``rel``, no escape; raises ``OSError``."""
    assert _syscall is not None
    how = _HOWS.get((flags, mode))
    if how is None:  # built once per (flags, mode): the struct is read-only to the kernel
        how = _HOWS[(flags, mode)] = _OpenHow(
            flags, mode, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
        )
    fd = int(_syscall(_SYS_OPENAT2, dir_fd, os.fsencode(rel), ctypes.byref(how), _HOW_SIZE))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), rel)
    return fd


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


def _refused(exc: OSError, where: Path) -> OSError:
    return OSError(exc.errno, "refusing to follow a symlink or non-directory", str(where))


def open_dir(root: Path, parts: Sequence[str], *, create: bool = False, sync_created: bool = False) -> int:
    """A descriptor of ``root/parts...`` that followed no symlink below ``root``.

    ``create`` makes missing directories (mode 0700; the root too, as before); ``sync_created`` then
    fsyncs the parent of each one made, so the new entry survives a power loss. A symlink or
    non-directory on the way raises ``OSError`` naming the path. The caller closes the descriptor.
    """
    for part in parts:
        if part in ("", ".", "..") or "/" in part:
            raise OSError(errno.EINVAL, "path component not allowed", str(root / part))
    if create and not root.is_dir():
        make_private_dirs(root)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if _syscall is not None and parts:  # the common case in one call: every directory exists
        try:
            child = _openat2(fd, "/".join(parts), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                os.close(fd)
                raise
        except OSError as exc:
            os.close(fd)
            if exc.errno in _REFUSED:
                raise _refused(exc, root.joinpath(*parts)) from None
            raise
        else:
            os.close(fd)
            return child
    try:
        where = root
        for part in parts:
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
                if exc.errno in _REFUSED:
                    raise _refused(exc, where) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


class DirCache:
    """Directory descriptors below one or more roots, opened one component at a time relative to
    their (cached) parent with ``O_NOFOLLOW | O_DIRECTORY`` and kept for a batch of operations, so
    a batch of blocks costs one open (or mkdir + open) per directory it touches, not a walk per block.
    Refuses what :func:`open_dir` refuses; close it (or use it as a context manager) when done."""

    def __init__(self, *, create: bool = False, sync_created: bool = False) -> None:
        self.create = create
        self.sync_created = sync_created
        self._fds: dict[tuple[Path, tuple[str, ...]], int] = {}

    def __enter__(self) -> DirCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def get(self, root: Path, parts: tuple[str, ...]) -> int:
        """The descriptor of ``root/parts...`` (owned by the cache: do not close it)."""
        fd = self._fds.get((root, parts))
        if fd is not None:
            return fd
        if not parts:
            fd = open_dir(root, (), create=self.create)
        else:
            part = parts[-1]
            if part in ("", ".", "..") or "/" in part:
                raise OSError(errno.EINVAL, "path component not allowed", str(root.joinpath(*parts)))
            fd = self._open_child(self.get(root, parts[:-1]), part, root, parts)
        self._fds[(root, parts)] = fd
        return fd

    def _open_child(self, parent: int, part: str, root: Path, parts: tuple[str, ...]) -> int:
        try:
            try:
                return os.open(part, _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                if not self.create:
                    raise
            with contextlib.suppress(FileExistsError):  # a concurrent writer made it first
                os.mkdir(part, 0o700, dir_fd=parent)
                if self.sync_created:
                    os.fsync(parent)
            return os.open(part, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in _REFUSED:
                raise _refused(exc, root.joinpath(*parts)) from None
            raise


@contextlib.contextmanager
def parent_dir(
    root: Path, parts: Sequence[str], *, create: bool = False, sync_created: bool = False
) -> Iterator[int]:
    """:func:`open_dir` of the directory holding ``root/parts...`` (its last part is the file),
    closed on exit."""
    fd = open_dir(root, parts[:-1], create=create, sync_created=sync_created)
    try:
        yield fd
    finally:
        os.close(fd)


def open_block(root: Path, parts: Sequence[str], flags: int) -> int:
    """Open the regular file ``root/parts...`` (no symlink followed below ``root``, the file
    included); :class:`NotRegularFile` for a symlink, FIFO, socket or device there."""
    if _syscall is None:
        return open_block_sized(-1, root, parts, flags)[0]
    rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return open_block_sized(rfd, root, parts, flags)[0]
    finally:
        os.close(rfd)


def open_block_sized(root_fd: int, root: Path, parts: Sequence[str], flags: int) -> tuple[int, int]:
    """:func:`open_block` below ``root_fd`` (a descriptor of ``root`` the caller keeps open across a
    batch; ignored where ``openat2`` is missing), and the file's size from the ``fstat`` that proved
    it regular (so a reader need not ask again)."""
    if _syscall is None:
        with parent_dir(root, parts) as dfd:
            return open_regular_sized(parts[-1], flags, dir_fd=dfd, shown=str(root.joinpath(*parts)))
    rel = "/".join(parts)
    try:
        fd = _openat2(root_fd, rel, flags | _FILE_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the file or a directory on the way is a symlink
            raise NotRegularFile(str(root / rel), "symlink") from None
        if exc.errno in _REFUSED:
            raise _refused(exc, root / rel) from None
        if exc.filename == rel:
            exc.filename = str(root / rel)  # name the whole path in messages
        raise
    return _keep_regular(fd, "")


def open_regular(name: str, flags: int, *, dir_fd: int, mode: int = 0o600, shown: str = "") -> int:
    """Open ``name`` in ``dir_fd`` only if it is a regular file, without following a symlink.

    ``O_NONBLOCK`` makes opening a FIFO return at once (on a regular file it has no effect, so it
    is left set). Raises :class:`NotRegularFile` (an ``OSError``) for anything else.
    """
    return open_regular_sized(name, flags, dir_fd=dir_fd, mode=mode, shown=shown)[0]


def open_regular_sized(
    name: str, flags: int, *, dir_fd: int, mode: int = 0o600, shown: str = ""
) -> tuple[int, int]:
    """:func:`open_regular` and the file's size."""
    try:
        fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(shown or name, "symlink") from None
        raise
    return _keep_regular(fd, shown or name)


def _keep_regular(fd: int, shown: str) -> tuple[int, int]:
    """``fd`` and its size if ``fstat`` says regular file, else closed and refused (named
    ``shown``, or by the descriptor's own path when empty). ``O_NONBLOCK`` stays: reads and writes
    of a regular file ignore it, and clearing it cost a syscall per block on the data path."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            where = shown or str(Path(f"/proc/self/fd/{fd}").readlink())
            raise NotRegularFile(where, file_kind(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size
