"""Where a Posix tier keeps a block: the one place the directory layout is spelled.

``<root>/<namespace hex>/<k[0:2]>/<key hex>.blk``, the root chosen from the tier's roots by key so
blocks stripe across disks (format version 3, :data:`~ucm_server.store.format.FLAT_LAYOUT_VERSION`).
Releases before it wrote one directory level more, ``<namespace hex>/<k[0:2]>/<k[2:4]>/<key hex>.blk``
(format versions 1 and 2): 65,536 leaf directories per namespace, so while a store was small nearly
every new block paid a ``mkdir`` and a directory open besides its own file. Those files keep loading:
a read that finds no file at the new path tries the old one, a delete removes both, the start-up scan
adopts a file at the path its header's version names (and quarantines one anywhere else). A layout
that is not flat writes the old layout itself (a shared mount that nodes of older releases read).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

from ucm_protocol.keys import NAMESPACE_BYTES, BlockKey, Digest, Namespace
from ucm_server.store.format import FLAT_LAYOUT_VERSION, BlockHeader

SUFFIX = ".blk"
TMP_MARK = ".tmp."
"""Part of every temporary file's name: a write not renamed yet (removed at start-up when stale)."""
QUARANTINE = ".quarantine"
"""The directory below each root that corrupt files are moved into, never served from."""


def block_name(key: bytes) -> str:
    """The file name of ``key``'s block in its directory, in every layout: the digest in hex."""
    return f"{key[NAMESPACE_BYTES:].hex()}{SUFFIX}"


def block_key(key: bytes) -> BlockKey:
    """``key`` as a :class:`BlockKey` (index keys may be plain ``namespace + digest`` strings)."""
    return key if isinstance(key, BlockKey) else BlockKey(key[:NAMESPACE_BYTES], key[NAMESPACE_BYTES:])


class Layout:
    """The roots and the layout a tier writes (``flat``: version 3's, else versions 1 and 2's)."""

    __slots__ = ("flat", "prefixes", "roots", "shard_cut")

    def __init__(self, roots: Sequence[Path], *, flat: bool = True) -> None:
        self.roots = [Path(r) for r in roots]
        self.flat = flat
        self.prefixes = [os.fspath(root).rstrip("/") + "/" for root in self.roots]
        self.shard_cut = NAMESPACE_BYTES + (4 if len(self.roots) > 1 else 1 if flat else 2)
        """Bytes of a key that decide its directory: keys alike up to here share one."""

    def root_of(self, key: bytes) -> Path:
        if len(self.roots) == 1:  # asked per block on the data path: no slicing when there is no choice
            return self.roots[0]
        pick = int.from_bytes(key[NAMESPACE_BYTES : NAMESPACE_BYTES + 4], "little")
        return self.roots[pick % len(self.roots)]

    def place(self, key: bytes, *, flat: bool | None = None) -> tuple[Path, tuple[str, ...], str]:
        """Root, directories below it and file name of ``key``'s block, as strings. ``flat``: the
        two-level layout of format version 3 (``<ns>/<k[0:2]>/<key>.blk``) or, False, the one level
        deeper of versions 1 and 2 (``<ns>/<k[0:2]>/<k[2:4]>/<key>.blk``); None: the one written."""
        name, ns = block_name(key), key[:NAMESPACE_BYTES].hex()
        if self.flat if flat is None else flat:
            return self.root_of(key), (ns, name[:2]), name
        return self.root_of(key), (ns, name[:2], name[2:4]), name

    def path_of(self, key: bytes) -> Path:
        """Where ``key``'s block is written (and read first)."""
        root, parts, name = self.place(key)
        return root.joinpath(*parts, name)

    def legacy_path_of(self, key: bytes) -> Path:
        """Where format versions 1 and 2 put ``key``'s block: one directory level deeper."""
        root, parts, name = self.place(key, flat=False)
        return root.joinpath(*parts, name)

    def file_paths_of(self, key: bytes) -> list[Path]:
        """Every block file ``key`` may have: its path, and with the flat layout the one an older
        release left one level deeper (a read would find that next, so removing a block removes both)."""
        path = self.path_of(key)
        return [path, self.legacy_path_of(key)] if self.flat else [path]

    def expected_path(self, header: BlockHeader) -> str:
        """Where a file with ``header`` must be found: the layout its format version names."""
        root, parts, name = self.place(header.key, flat=header.version >= FLAT_LAYOUT_VERSION)
        return "/".join((os.fspath(root).rstrip("/"), *parts, name))

    def split(self, path: Path) -> tuple[Path, list[str]]:
        """The root holding ``path`` and the components below it (string work: on the data path,
        pathlib's ``relative_to`` would cost more than the opens)."""
        text = os.fspath(path)
        for root, prefix in zip(self.roots, self.prefixes, strict=True):
            if text.startswith(prefix):
                return root, text[len(prefix) :].split("/")
        raise OSError(errno.EXDEV, "path is outside the tier's roots", text)

    def key_at(self, path: str) -> BlockKey | None:
        """The block whose file (in either layout) ``path`` is; None for any other path."""
        root, parts = self.split(Path(path))
        try:
            ns, digest = bytes.fromhex(parts[0]), bytes.fromhex(parts[-1].removesuffix(SUFFIX))
        except (ValueError, IndexError):
            return None
        if len(parts) not in (3, 4) or len(ns) != NAMESPACE_BYTES or len(digest) != 32:
            return None
        key = BlockKey(Namespace(ns), Digest(digest))
        if root != self.root_of(key) or Path(path) not in (self.path_of(key), self.legacy_path_of(key)):
            return None
        return key
