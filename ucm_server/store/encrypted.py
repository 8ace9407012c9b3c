"""Encryption at rest, per tenant: a wrapper tier that seals each block with its tenant's key.

KV bytes reveal the prompts they were computed from, so a tenant may keep its blocks encrypted on
disk (and on shared tiers): the tokens file names a key file for the tenant (``key_file``), and the
tiers named in ``encrypt_tiers`` are wrapped in :class:`EncryptedTier`. Blocks of a namespace whose
owner has a key are stored as an *envelope* inside the wrapped tier's payload::

    magic "UCMAEAD1" | alg u8 (1 = AES-256-GCM) | 3 zero bytes | key id 8s | nonce 12s |
    ciphertext (the block's length) | GCM tag 16s

The associated data is the envelope's head (magic, alg, key id, nonce) and the block's namespace and
key, so an envelope moved under another block's name, another namespace or another tenant fails
authentication; the key id (a hash of the key, which reveals nothing of it) tells a block sealed
under another key apart from a damaged one. The wrapped tier's own header and checksum still cover
the envelope: a torn or flipped file is caught there first, as for any block.

What a reader gets is never garbage: a block sealed under another key, one found without the key
(the tenant's key file was removed), or a plain block in a namespace that now has a key (stored
before the key was configured) are reported MISSING; an envelope that fails authentication
(tampered, or swapped from another block) is FAILED. Lookups report the plaintext size
(stored size - :data:`OVERHEAD`) for namespaces with a key. Blocks of namespaces without a key (the
default tenant, tenants without ``key_file``) pass through unchanged: old files keep loading.

The key never leaves :class:`TenantKey` (not logged, not in any message). The cipher is
``cryptography``'s AESGCM (OpenSSL, AES-NI); sealing runs in the daemon's executor, off the loop.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ucm_protocol.errors import ConfigError
from ucm_protocol.keys import BlockKey
from ucm_server.journal import read_regular
from ucm_server.store.base import BlockResult, BlockState, IoVec, Tier, copy_iov, failed, iov_len
from ucm_server.store.transform import TransformTier

T = TypeVar("T")

MAGIC = b"UCMAEAD1"
ALG_AES256_GCM = 1
_HEAD = struct.Struct("<8sB3x8s12s")
TAG_BYTES = 16
OVERHEAD = _HEAD.size + TAG_BYTES
"""Bytes an envelope adds to a block (48)."""
KEY_BYTES = 32
NO_KEY = BlockResult(BlockState.MISSING, "encrypted, and its tenant has no key here")
LOCKED_WRITE = BlockResult(
    BlockState.FAILED, "its tenant's blocks are encrypted and its key_file is not configured"
)


@dataclass(frozen=True, slots=True)
class TenantKey:
    """One tenant's key: its id (a hash, safe to store) and the cipher (the key itself stays here)."""

    key_id: bytes
    aead: AESGCM | None = field(repr=False)
    """``None``: a tenant whose blocks are sealed but whose key is not configured now (locked)."""

    @classmethod
    def from_bytes(cls, key: bytes) -> TenantKey:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes")
        key_id = hashlib.sha256(b"ucm-at-rest-key-id\0" + key).digest()[:8]
        return cls(key_id, AESGCM(key))


LOCKED = TenantKey(b"", None)
"""The key of a tenant that had one and has none now: its blocks are sealed, none can be opened."""


def read_key_file(path: Path, tenant: str) -> TenantKey:
    """The key in ``path``: 32 raw bytes, or 64 hex digits (a trailing newline allowed).

    Whoever can write the key file, or replace it in its directory, chooses the key a tenant's blocks
    are sealed with (and so can read what is sealed after): the file must be owned by the daemon's
    uid and written by nobody else, and its directory must belong to the daemon's uid or root with
    no group or other write. A file others may read, a link or anything but a regular file is refused
    too. Every refusal names the file (never its content) and stops start-up."""
    where = f"key_file {path} (tenant {tenant!r})"
    _check_key_directory(path.parent, where)
    data = read_regular(path, where, "chmod 600 it, 32 bytes or 64 hex digits", 4096, check=_check_key_owner)
    if data is None:
        raise ConfigError(f"{where}: no such file")
    text = data.strip()
    try:
        key = bytes.fromhex(text.decode("ascii")) if len(text) == 2 * KEY_BYTES else data
    except (UnicodeDecodeError, ValueError):
        key = data
    if len(key) != KEY_BYTES:
        raise ConfigError(f"{where}: expected {KEY_BYTES} bytes or {2 * KEY_BYTES} hex digits")
    return TenantKey.from_bytes(key)


def _check_key_owner(st: os.stat_result) -> str | None:
    """Why an open key file's ``fstat`` is refused (owner, write and read bits), or None."""
    me = os.geteuid()
    if st.st_uid != me:
        return f"owned by uid {st.st_uid}, not by the daemon's uid {me}; chown it to uid {me}"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {st.st_mode & 0o777:o}); chmod 600 it"
    if st.st_mode & 0o077:
        return f"readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it"
    return None


def _check_key_directory(directory: Path, where: str) -> None:
    """The key file's directory: the daemon's uid or root owns it and nobody else may write to it
    (else another user could put a key file of their choosing in its place)."""
    try:
        st = directory.stat()
    except OSError as exc:
        raise ConfigError(f"{where}: its directory {directory} cannot be read: {exc.strerror}") from None
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise ConfigError(
            f"{where}: its directory {directory} is owned by uid {st.st_uid}, not by the daemon's uid "
            f"{me} or root; keep key files in a directory of the daemon's user"
        )
    if st.st_mode & 0o022:
        raise ConfigError(
            f"{where}: its directory {directory} is writable by group or others (mode "
            f"{st.st_mode & 0o777:o}): anyone who can write there can replace the key; keep key "
            "files in a directory only the daemon's user can write (chmod go-w)"
        )


class Keyring(Protocol):
    def key_for(self, namespace: bytes) -> TenantKey | None:
        """The key of the tenant owning ``namespace``; ``None``: stored in clear."""
        ...


def _aad(head: bytes, key: BlockKey) -> bytes:
    return head + bytes(key)


def seal(tk: TenantKey, key: BlockKey, src: IoVec) -> bytes:
    """The envelope of ``src`` for block ``key`` (any thread)."""
    assert tk.aead is not None, "a locked tenant's blocks are never written"
    nonce = os.urandom(12)
    head = _HEAD.pack(MAGIC, ALG_AES256_GCM, tk.key_id, nonce)
    plain = b"".join(src) if len(src) != 1 else src[0]
    return head + tk.aead.encrypt(nonce, plain, _aad(head, key))


def open_envelope(tk: TenantKey | None, key: BlockKey, stored: memoryview, dest: IoVec) -> BlockResult:
    """Check and decrypt ``stored`` (an envelope) into ``dest`` (any thread); MISSING or FAILED
    with the reason otherwise, ``dest`` untouched."""
    if len(stored) < OVERHEAD or bytes(stored[:8]) != MAGIC:
        return BlockResult(BlockState.MISSING, "stored in clear before its tenant had a key")
    _, alg, key_id, nonce = _HEAD.unpack_from(stored)
    if tk is None or tk.aead is None:
        return NO_KEY
    if alg != ALG_AES256_GCM or key_id != tk.key_id:
        return BlockResult(BlockState.MISSING, "encrypted under another key")
    head = bytes(stored[: _HEAD.size])
    try:
        plain = tk.aead.decrypt(nonce, stored[_HEAD.size :], _aad(head, key))
    except InvalidTag:
        return failed("encrypted block fails authentication (tampered, or moved from another block)")
    if len(plain) != iov_len(dest):
        return failed(f"length mismatch: block is {len(plain)} bytes, destination {iov_len(dest)}")
    copy_iov(dest, [memoryview(plain)])
    return BlockResult(BlockState.OK)


class EncryptedTier(TransformTier):
    """``inner`` with the blocks of keyed namespaces sealed (see the module docstring)."""

    def __init__(self, inner: Tier, keyring: Keyring, executor: Executor | None = None) -> None:
        super().__init__(inner, executor)
        self.keyring = keyring

    def reader_size(self, namespace: bytes, stored: int | None) -> int | None:
        """The plaintext's: the envelope's overhead less, for namespaces with a key."""
        if stored is None or self.keyring.key_for(namespace) is None:
            return stored
        return stored - OVERHEAD if stored > OVERHEAD else None

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Seal the keyed blocks (off the loop), then one batch to the inner tier."""
        tks = [self.keyring.key_for(k.namespace) for k, _ in items]
        if not any(tks):
            return await self.inner.write_many(items)
        results: list[BlockResult] = [LOCKED_WRITE] * len(items)
        todo = [i for i, tk in enumerate(tks) if tk is not LOCKED]

        def seal_all() -> list[tuple[BlockKey, IoVec]]:
            out: list[tuple[BlockKey, IoVec]] = []
            for i in todo:
                (k, src), tk = items[i], tks[i]
                out.append((k, [memoryview(seal(tk, k, src))] if tk is not None else src))
            return out

        for i, r in zip(todo, await self.inner.write_many(await self._run(seal_all)), strict=True):
            results[i] = r
        return results

    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Keyed blocks are read whole into scratch memory, opened there, copied to ``dest``; other
        blocks straight into ``dest``, refused there if they are an envelope (a tenant whose key
        is gone: never ciphertext for plaintext)."""
        tks = [self.keyring.key_for(k.namespace) for k, _ in items]
        reads = [
            (k, [memoryview(bytearray(iov_len(dest) + OVERHEAD))] if tk is not None else dest)
            for (k, dest), tk in zip(items, tks, strict=True)
        ]
        got = await self.inner.read_many(reads)

        def open_all() -> list[BlockResult]:
            out: list[BlockResult] = []
            for (key, dest), tk, (_, stored), r in zip(items, tks, reads, got, strict=True):
                if not r.ok:
                    out.append(r)
                elif tk is not None:
                    out.append(open_envelope(tk, key, stored[0], dest))
                elif _starts_with_magic(dest):
                    _zero(dest)
                    out.append(NO_KEY)
                else:
                    out.append(r)
            return out

        return await self._run(open_all)


def _starts_with_magic(iov: IoVec) -> bool:
    head = b"".join(bytes(seg[: len(MAGIC)]) for seg in iov[:8])[: len(MAGIC)]
    return head == MAGIC


def _zero(iov: IoVec) -> None:
    for seg in iov:
        seg[:] = bytes(seg.nbytes)
