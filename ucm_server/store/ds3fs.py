"""The DS3FS tier: blocks as files on a DeepSeek 3FS mount that many nodes share.

It is the Posix tier (same header, same temp-file + fsync + atomic-rename durability, same quarantine
of corrupt files) with the older layout that nodes of older releases read, and three differences that
come from sharing the directory tree. What it changes in the Posix tier's own behaviour is stated in
one place, the :class:`~ucm_server.store.posix.Profile` it passes (layout, reads, start-up, timeouts);
the rest is its own lookup, read and write paths:

* **Lookups that miss the local index check the filesystem**, in one batched executor job (a ``stat``
  and a 128-byte header read per unknown key), because other nodes' daemons write there too. Keys found
  absent are remembered for ``negative_ttl_s`` (default 1 s) so a scheduler asking about the same
  prefix every step does not hit the metadata service every step; a write by this node clears its entry.
  Keys the index knows are re-checked once older than ``positive_ttl_s`` (default 5 s), and at once
  when a reader's size disagrees, so another node's delete or rewrite is seen.
* **Start-up does not scan the mount by default** (``scan_on_open``): with lookups falling through to
  the filesystem the index is a cache, and a full scan of a cluster-wide tree at every daemon start is
  slow. Temporary files are removed only when older than ``stale_tmp_s``: a young one may be another
  node's write in flight. :meth:`list_blocks` walks the tree, not the index.
* **Bulk I/O uses USRBIO** (``hf3fs_fuse.io``: a shared-memory iovec registered with the FUSE daemon,
  io rings, registered fds, one batched submit per ring's worth) when ``hf3fs_fuse`` imports; otherwise
  plain POSIX ``preadv``/``pwritev`` on the mount. :meth:`open` logs which one it uses.

Every file operation runs under ``timeout_s``: a hung mount turns into per-block FAILED results counted
in ``stats().errors``, not a stuck daemon.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from ucm_protocol.errors import ConfigError, Unavailable
from ucm_protocol.keys import KEY_BYTES, NAMESPACE_BYTES, BlockKey, Digest, Namespace
from ucm_server.store.base import (
    DEFAULT_CONTEXT,
    DEFAULT_MAX_BLOCK_BYTES,
    MISSING,
    OK,
    BlockInfo,
    BlockResult,
    IoVec,
    TierContext,
    bounded_gather,
    copy_iov,
    failed,
    iov_len,
    load_tier_settings,
)
from ucm_server.store.format import (
    HEADER_SIZE,
    CorruptBlock,
    decode_header,
    encode_header,
    payload_checksum,
    verify_payload,
)
from ucm_server.store.posix import QUARANTINE, SUFFIX, TMP_MARK, Entry, PosixTier, Profile, files, unlink_at
from ucm_server.store.posix.confined import NotRegularFile
from ucm_server.store.usrbio import Usrbio

log = logging.getLogger(__name__)

UsrbioMode = Literal["auto", "on", "off"]


@dataclass(frozen=True, slots=True)
class DS3FSSettings:
    """The DS3FS tier's ``tier_settings`` entry: one field per key, with the constructor's defaults."""

    mount: str
    """the 3FS mount point (``/3fs/stage``...); USRBIO needs the mount root itself."""
    subdir: str = "ucm"
    """directory under the mount holding the blocks; nodes sharing blocks agree on it."""
    capacity: int = 0
    """bytes this node lets the tier hold before evicting (0: unlimited). Eviction only considers
    blocks this node knows of."""
    durable: bool = True
    """fsync file and directory before a block is visible (see the Posix tier)."""
    usrbio: UsrbioMode = "auto"
    """``"auto"`` uses USRBIO when ``hf3fs_fuse`` imports, ``"on"`` requires it (``open`` fails
    otherwise), ``"off"`` always uses POSIX I/O."""
    usrbio_buffer_bytes: int = 64 << 20
    """size of the shared-memory iovec; batches are cut to fit it, and a block larger than it goes
    through POSIX I/O."""
    io_entries: int = 256
    """io ring entries (blocks per submit)."""
    negative_ttl_s: float = 1.0
    """how long a key found absent on the mount is not looked for again."""
    positive_ttl_s: float = 5.0
    """how long a key known present is trusted before a lookup checks the mount again (another node
    may have deleted or rewritten it)."""
    timeout_s: float = 30.0
    """limit on one file operation (or one USRBIO batch); past it: FAILED."""
    scan_on_open: bool = False
    """index every block on the mount at ``open`` (slow on a big shared tree)."""
    stale_tmp_s: float = 3600.0
    """temporary files older than this are interrupted writes and are removed."""


class DS3FSTier(PosixTier):
    """A Posix tier on a 3FS mount shared by many nodes (see the module docstring)."""

    kind: ClassVar[str] = "DS3FS"
    persistent: ClassVar[bool] = True
    shared: ClassVar[bool] = True
    pin_gap: ClassVar[str] = "a shared tier: other nodes' daemons evict from it without this daemon's pins"

    def __init__(
        self,
        name: str = "DS3FS",
        *,
        mount: Path | str,
        subdir: str = "ucm",
        capacity: int = 0,
        durable: bool = True,
        executor: Executor | None = None,
        usrbio: UsrbioMode = "auto",
        usrbio_buffer_bytes: int = 64 << 20,
        io_entries: int = 256,
        negative_ttl_s: float = 1.0,
        positive_ttl_s: float = 5.0,
        timeout_s: float = 30.0,
        scan_on_open: bool = False,
        stale_tmp_s: float = 3600.0,
        max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
    ) -> None:
        """The parameters are the keys of :class:`DS3FSSettings`, documented there, and

        :param max_block_bytes: a stored header claiming a larger payload is corrupt (the daemon
            passes its own, through :class:`~ucm_server.store.base.TierContext`).
        """
        self.mount = Path(mount)
        # Buffered writes only: USRBIO and other nodes' readers expect the 128-byte header.
        super().__init__(
            name,
            roots=[self.mount / subdir],
            capacity=capacity,
            durable=durable,
            direct_io=False,
            executor=executor,
            max_block_bytes=max_block_bytes,
            profile=Profile(
                flat_layout=False,  # versions 1 and 2: nodes of older releases share this mount and read it
                client_reads=False,  # its own read path (USRBIO, negative lookups) decides
                index_snapshots=False,  # other nodes change the tree: scan before serving, if at all
                temp_grace_s=stale_tmp_s,  # a younger temporary file may be another node's write in flight
                timeout_s=timeout_s,  # a hung mount must not hang the daemon
            ),
        )
        if usrbio not in ("auto", "on", "off"):
            raise ConfigError(f"tier {name!r}: usrbio must be auto, on or off, got {usrbio!r}")
        if (
            timeout_s <= 0
            or negative_ttl_s < 0
            or positive_ttl_s < 0
            or io_entries < 1
            or usrbio_buffer_bytes <= HEADER_SIZE
        ):
            raise ConfigError(
                f"tier {name!r}: timeout_s, negative_ttl_s, io_entries or buffer size out of range"
            )
        self.usrbio_mode: UsrbioMode = usrbio
        self.usrbio_buffer_bytes = usrbio_buffer_bytes
        self.io_entries = io_entries
        self.negative_ttl_s = negative_ttl_s
        self.positive_ttl_s = positive_ttl_s
        self.timeout_s = timeout_s
        self.scan_on_open = scan_on_open
        self.stale_tmp_s = stale_tmp_s
        self._absent: dict[BlockKey, float] = {}
        """Keys found absent on the mount, until when that is believed."""
        self._checked: dict[BlockKey, float] = {}
        """When each indexed key was last found (or written) on the mount."""
        self._usrbio: Usrbio | None = None

    # -- configuration -----------------------------------------------------------------------------------
    Settings: ClassVar[type[Any] | None] = DS3FSSettings

    @classmethod
    def from_settings(
        cls, name: str, settings: Mapping[str, object], context: TierContext = DEFAULT_CONTEXT
    ) -> Self:
        """Build from a pipeline's per-tier settings (``mount`` is required); errors name the key.
        Headers above ``context.max_block_bytes`` are corrupt, as in the Posix tier."""
        values = load_tier_settings(cls, name, settings)
        return cls(name, max_block_bytes=context.max_block_bytes, **values)

    # -- life cycle ---------------------------------------------------------------------------------------
    async def open(self) -> None:
        if not self.mount.is_dir():
            raise Unavailable(f"tier {self.name!r}: 3FS mount {self.mount} is not a directory")
        if self.scan_on_open:
            await super().open()
            for key, _ in self._index.items():
                self._seen(key)
        else:
            await self._run(lambda: self.roots[0].mkdir(parents=True, exist_ok=True, mode=0o700))
        if self.usrbio_mode != "off":
            try:
                import hf3fs_fuse.io as h3io
            except ImportError as exc:
                if self.usrbio_mode == "on":
                    raise Unavailable(
                        f"tier {self.name!r}: usrbio=on but hf3fs_fuse does not import ({exc})"
                    ) from exc
                log.info(
                    "%s: hf3fs_fuse not importable (%s): using POSIX I/O on %s", self.name, exc, self.mount
                )
            else:
                self._usrbio = await self._run(
                    lambda: Usrbio(h3io, self.mount, self.usrbio_buffer_bytes, self.io_entries)
                )
        log.info(
            "%s: 3FS tier at %s using %s",
            self.name,
            self.roots[0],
            "USRBIO (hf3fs_fuse.io)" if self._usrbio is not None else "POSIX I/O",
        )

    async def close(self) -> None:
        if self._usrbio is not None:
            self._usrbio.close()
            self._usrbio = None
        await super().close()

    @property
    def io_path(self) -> str:
        """``"usrbio"`` or ``"posix"``: what bulk I/O goes through (for stats and tests)."""
        return "usrbio" if self._usrbio is not None else "posix"

    # -- shared-tree lookups ------------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """The local index, then one batched filesystem check for keys it does not know."""
        await self._discover(keys)
        return list(map(self._index.get, keys))

    async def _discover(self, keys: Sequence[BlockKey], *, force: bool = False) -> None:
        """Bring the index up to date for ``keys``: unknown keys not recently found absent, and known
        keys not checked for ``positive_ttl_s`` (another node may have deleted or rewritten them),
        are checked on the mount in one executor job. ``force`` checks every key."""
        now = time.monotonic()
        probe = []
        for k in dict.fromkeys(keys):
            if k in self._index:
                if force or self._checked.get(k, 0.0) + self.positive_ttl_s <= now:
                    probe.append(k)
            elif force or self._absent.get(k, 0.0) <= now:
                probe.append(k)
        if not probe:
            return
        try:
            found = await self._run(self._probe_files, probe)
        except OSError as exc:
            self._stats.errors += 1
            log.warning("%s: lookup on %s failed: %s", self.name, self.mount, exc)
            return
        now = time.monotonic()
        if len(self._absent) > 100_000:
            self._absent = {k: t for k, t in self._absent.items() if t > now}
        if len(self._checked) > 100_000:  # keys forgotten since (a failed read, an eviction)
            self._checked = {k: t for k, t in self._checked.items() if k in self._index}
        for key in probe:
            entry = found.get(key)
            if entry is None:
                self._forget(key)
                self._checked.pop(key, None)
                self._absent[key] = now + self.negative_ttl_s
            elif self._index.get(key) != entry.size:
                self._forget(key)
                self._remember(key, entry)
                self._seen(key)
            else:
                self._checked[key] = now

    def _seen(self, key: BlockKey) -> None:
        """``key`` is on the mount now (found there, or written by this node)."""
        self._checked[key] = time.monotonic()
        self._absent.pop(key, None)

    def _probe_files(self, keys: list[BlockKey]) -> dict[BlockKey, Entry]:
        found: dict[BlockKey, Entry] = {}
        for key in keys:
            path = self.path_of(key)
            try:  # the Posix tier's confined open: no symlink followed, regular files only
                fd = files.open_block_file(self.disk, path)
            except (FileNotFoundError, NotRegularFile):
                continue  # absent, or not a block (counted in skipped_files)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    continue  # a symlinked directory on the way: not followed, so not there
                raise
            try:
                raw = os.pread(fd, HEADER_SIZE, 0)
                header = decode_header(raw, expect=key, max_payload=self.max_block_bytes)
                size = os.fstat(fd).st_size
            except CorruptBlock as exc:
                files.move_to_quarantine(self.disk, path, str(exc))
                continue
            finally:
                os.close(fd)
            if size == HEADER_SIZE + header.payload_len:
                found[key] = Entry(size=header.payload_len, stored_at=header.created_ns / 1e9)
        return found

    # -- primitives over the shared tree ----------------------------------------------------------------
    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        return (await self.read_many([(key, dest)]))[0]

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        return (await self.write_many([(key, src)]))[0]

    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        await self._discover([k for k, _ in items])
        # A size that disagrees with the reader's may be another node's rewrite: look again.
        stale = [k for k, d in items if (size := self._index.get(k)) is not None and size != iov_len(d)]
        if stale:
            await self._discover(stale, force=True)
        if self._usrbio is None:
            return await bounded_gather(
                self.max_concurrency, [super(DS3FSTier, self).read_into(k, d) for k, d in items]
            )
        return await self._usrbio_batches(items, read=True)

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        for key, _ in items:
            self._absent.pop(key, None)
        if self._usrbio is None:
            results = await bounded_gather(
                self.max_concurrency, [super(DS3FSTier, self).write_from(k, s) for k, s in items]
            )
        else:
            results = await self._usrbio_batches(items, read=False)
        for (key, _), result in zip(items, results, strict=True):
            if result.ok:
                self._seen(key)
        return results

    async def verify(self, key: BlockKey, *, quarantine: bool = True) -> BlockResult:
        await self._discover([key])
        return await super().verify(key, quarantine=quarantine)

    async def delete(self, keys: Sequence[BlockKey]) -> int:
        """Blocks written by other nodes are deleted too: unknown keys are looked up first."""
        await self._discover(keys)
        for key in keys:
            self._checked.pop(key, None)
        return await super().delete(keys)

    async def list_blocks(self, namespace: Namespace | None = None) -> AsyncIterator[BlockInfo]:
        """Walk the tree (other nodes' blocks included); sizes come from file sizes, not headers."""
        for info in await self._run(self._walk, namespace):
            yield info

    def _walk(self, namespace: Namespace | None) -> list[BlockInfo]:
        root = self.roots[0]
        tops = (
            [root / namespace.hex()] if namespace is not None else [p for p in root.iterdir() if p.is_dir()]
        )
        out: list[BlockInfo] = []
        for top in tops:
            if top.name == QUARANTINE or top.is_symlink() or not top.is_dir():
                continue
            try:
                ns = bytes.fromhex(top.name)
            except ValueError:
                continue
            for dirpath, _, filenames in os.walk(top):
                for fname in filenames:
                    if not fname.endswith(SUFFIX) or TMP_MARK in fname:
                        continue
                    try:
                        digest = bytes.fromhex(fname[: -len(SUFFIX)])
                        st = (Path(dirpath) / fname).lstat()
                    except (ValueError, OSError):
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue  # a symlink or FIFO is not a block (reads refuse it too)
                    if len(ns) != NAMESPACE_BYTES or len(digest) != KEY_BYTES or st.st_size < HEADER_SIZE:
                        continue
                    key = BlockKey(Namespace(ns), Digest(digest))
                    out.append(
                        BlockInfo(
                            key=key, size=st.st_size - HEADER_SIZE, tier=self.name, stored_at=st.st_mtime
                        )
                    )
        return out

    # -- USRBIO batches ---------------------------------------------------------------------------------
    async def _usrbio_batches(
        self, items: Sequence[tuple[BlockKey, IoVec]], *, read: bool
    ) -> list[BlockResult]:
        assert self._usrbio is not None
        results: list[BlockResult] = [failed("not attempted")] * len(items)
        batch: list[int] = []
        used = 0
        batches: list[list[int]] = []
        loose: list[int] = []
        for i, (key, iov) in enumerate(items):
            size = HEADER_SIZE + iov_len(iov)
            if read:
                entry = self._index.get(key)
                if entry is None:
                    self._stats.misses += 1
                    results[i] = MISSING
                    continue
                if entry.size != iov_len(iov):
                    results[i] = failed(
                        f"length mismatch: block is {entry.size} bytes, destination {iov_len(iov)}"
                    )
                    continue
            if size > self.usrbio_buffer_bytes:
                loose.append(i)
                continue
            if used + size > self.usrbio_buffer_bytes or len(batch) >= self.io_entries:
                batches.append(batch)
                batch, used = [], 0
            batch.append(i)
            used += size
        if batch:
            batches.append(batch)
        for b in batches:
            chunk = [items[i] for i in b]
            try:
                if read:
                    out = await self._run(self._usrbio_read, chunk)
                else:
                    out = await self._run(self._usrbio_write, chunk)
            except OSError as exc:
                self._stats.errors += 1
                out = [failed(f"{self.name} USRBIO {'read' if read else 'write'} error: {exc}")] * len(b)
            for i, r in zip(b, out, strict=True):
                results[i] = r
        fallback = PosixTier.read_into if read else PosixTier.write_from
        for i in loose:
            results[i] = await fallback(self, *items[i])
        return results

    def _usrbio_read(self, chunk: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        assert self._usrbio is not None
        with self._usrbio.lock:  # the views below point into the shared iovec: hold it until copied
            return self._usrbio_read_locked(chunk)

    def _usrbio_read_locked(self, chunk: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        assert self._usrbio is not None
        paths = [self.path_of(k) for k, _ in chunk]
        sizes = [HEADER_SIZE + iov_len(d) for _, d in chunk]
        outcome = self._usrbio.read(paths, sizes, functools.partial(files.open_block_file, self.disk))
        results: list[BlockResult] = []
        for (key, dest), (view, err) in zip(chunk, outcome, strict=True):
            if isinstance(err, FileNotFoundError):
                self._forget(key)
                self._stats.misses += 1
                results.append(MISSING)
                continue
            if err is not None:
                self._stats.errors += 1
                results.append(failed(f"{self.name} read error: {err}"))
                continue
            try:
                header = decode_header(view[:HEADER_SIZE], expect=key)
                verify_payload(header, [view[HEADER_SIZE:]])
            except CorruptBlock as exc:
                self._forget(key)
                files.move_to_quarantine(self.disk, self.path_of(key), str(exc))
                results.append(failed(f"corrupt block in {self.name}: {exc}"))
                continue
            copy_iov(dest, [view[HEADER_SIZE:]])
            self._index.move_to_end(key)
            self._stats.hits += 1
            self._stats.read_bytes += header.payload_len
            results.append(OK)
        return results

    def _usrbio_write(self, chunk: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Temp file written through the ring, fsync, rename, directory fsync: the Posix rules."""
        assert self._usrbio is not None
        finals = [self.path_of(k) for k, _ in chunk]
        tmps = [p.with_name(f"{p.name}{TMP_MARK}{uuid.uuid4().hex[:12]}") for p in finals]
        blobs: list[list[memoryview]] = []
        for key, src in chunk:
            n = iov_len(src)
            blobs.append([memoryview(encode_header(key, n, payload_checksum(src))), *src])
        errors = self._usrbio.write(tmps, blobs, durable=self.durable, create=self._create_tmp)
        results: list[BlockResult] = []
        for (key, src), tmp, final, write_err in zip(chunk, tmps, finals, errors, strict=True):
            err = write_err
            if err is None:
                try:
                    with files.parent(self.disk, final) as dfd:
                        os.replace(tmp.name, final.name, src_dir_fd=dfd, dst_dir_fd=dfd)
                        if self.durable:
                            os.fsync(dfd)
                except OSError as exc:
                    err = exc
            if err is not None:
                with contextlib.suppress(OSError), files.parent(self.disk, tmp) as dfd:
                    unlink_at(dfd, tmp.name)
                self._stats.errors += 1
                results.append(failed(f"{self.name} write error: {err}"))
                continue
            n = iov_len(src)
            self._forget(key)
            self._remember(key, Entry(size=n, stored_at=time.time()))
            self._stats.write_bytes += n
            results.append(OK)
        return results

    # -- helpers ----------------------------------------------------------------------------------------
    def _create_tmp(self, tmp: Path) -> int:
        """A new temporary block file, created like the Posix tier does: its directories made and
        fsynced without following symlinks, the file itself ``O_EXCL | O_NOFOLLOW``."""
        with files.parent(self.disk, tmp, create=True) as dfd:
            return files.create_tmp(dfd, tmp.name)
