"""A small durable journal file: lines appended and fsynced, or the whole file replaced atomically.

The tenant ledger and the retention rules keep their state the same way: a snapshot line, then one
line per change appended (and fsynced, in a worker thread) before the change takes effect; start-up
rewrites the file as one snapshot (temp file, fsync, rename, fsync of the directory). This is that
file, once; each owner keeps its own line format and its own reading of damage.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from ucm_protocol.errors import ConfigError
from ucm_server.api.paths import fsync_dir


class JournalFile:
    """``path``'s appends and rewrites, never interleaved (any thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def append(self, line: bytes) -> None:
        """Append ``line`` durably (the directory too when the file is new)."""
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(self.path, flags, 0o600)
            try:
                created = os.fstat(fd).st_size == 0
                write_all(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
            if created:
                fsync_dir(self.path.parent)

    def rewrite(self, data: bytes) -> None:
        """Replace the file with ``data`` whole, or leave it as it was."""
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.unlink(missing_ok=True)  # left by a crash mid-rewrite
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            fsync_dir(self.path.parent)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_regular(
    path: Path,
    what: str,
    fix: str,
    max_bytes: int,
    *,
    private: bool = False,
    check: Callable[[os.stat_result], str | None] | None = None,
) -> bytes | None:
    """The file's bytes, or None if absent; a FIFO, device or symlink is refused, never opened
    blocking, and with ``private`` so is a file others may read (:class:`ConfigError` reading
    ``"<what>: <why>; <fix>"``). ``check`` judges the opened file's ``fstat`` first (its answer, when
    not None, is the whole ``"<why>; <fix>"``): the file read is the file checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"{what}: cannot open it: {exc.strerror}; {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what}: not a regular file; {fix}")
        if check is not None and (why := check(st)) is not None:
            raise ConfigError(f"{what}: {why}")
        if private and st.st_mode & 0o077:
            raise ConfigError(f"{what}: readable by others (mode {st.st_mode & 0o777:o}); {fix}")
        if st.st_size > max_bytes:
            raise ConfigError(f"{what}: {st.st_size} bytes is too large to be one; {fix}")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read it: {exc.strerror}; {fix}") from None
    finally:
        os.close(fd)


def remember_names(path: Path, add: Iterable[str], what: str, fix: str) -> set[str]:
    """The names listed in ``path`` (a JSON list) plus ``add``, written back durably when that adds
    any: a set that only grows, for what the daemon must not forget once done (tenants whose blocks
    were sealed, tiers that hold encoded blocks). A damaged file stops start-up naming ``what``."""
    data = read_regular(path, f"{what} {path}", fix, 64 << 20)
    try:
        known = json.loads(data) if data else []
        if not isinstance(known, list) or not all(isinstance(t, str) for t in known):
            raise ValueError("expected a JSON list of names")
    except ValueError as exc:
        raise ConfigError(f"{what} {path}: {exc}; {fix}") from None
    names = set(known) | set(add)
    if names != set(known):
        JournalFile(path).rewrite((json.dumps(sorted(names)) + "\n").encode())
    return names
