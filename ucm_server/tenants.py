"""Per-tenant byte quotas, each tenant evicting its own least-recently-used blocks.

The ledger knows which (private) namespace belongs to which tenant — persisted in
``<data_dir>/tenants.json`` so usage can be rebuilt from the persistent tiers after a restart — and
how many bytes each tenant keeps. A write that takes a tenant over its quota evicts that tenant's
oldest blocks, never another tenant's.

The file is a journal, one JSON document per line: a snapshot ``{"namespaces": {hex: tenant}}`` first
(the whole file written by 0.1 is such a line, without the newline), then one
``{"ns": hex, "tenant": name}`` line per namespace claimed since. Only writes claim a namespace (a
Lookup never writes anything); a claim appends one line and fsyncs it in a worker thread before the
first block of that namespace is written, so a crash can lose at most a line that no block depends
on, and such a torn last line is skipped at start. Start-up rewrites the file as one snapshot of the
namespaces that still hold blocks (temp file, fsync, rename, fsync of the directory), which keeps it
bounded by what is stored. A file that is damaged in any other way stops start-up with a message
naming the file and the damage: the daemon does not guess who owns what.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from pathlib import Path

from ucm_protocol.errors import ConfigError, Unavailable
from ucm_protocol.keys import NAMESPACE_BYTES, BlockKey
from ucm_protocol.text import printable
from ucm_server.journal import JournalFile, read_regular, remember_names
from ucm_server.store.encrypted import LOCKED, TenantKey, read_key_file

log = logging.getLogger(__name__)

_FIX = (
    "fix the file, or move it aside to start with an empty ledger (blocks stay readable by their "
    "tenants; quotas then count only blocks written from then on)"
)
_MAX_LEDGER_BYTES = 1 << 30


class TenantLedger:
    def __init__(self, path: Path, quotas: dict[str, int], executor: Executor | None = None) -> None:
        self.path = path
        self.quotas = quotas
        self._executor = executor
        self._owner: dict[bytes, str] = read_ledger(path)
        self._blocks: dict[str, OrderedDict[BlockKey, int]] = {}
        self._bytes: dict[str, int] = {}
        self._pending: dict[bytes, asyncio.Future[None]] = {}
        self._file = JournalFile(path)  # appends and the rewrite never interleave
        self.pinned: Callable[[bytes], bool] = lambda key: False
        """Whether a block is pinned (the retention rules): quota eviction passes it over."""

    def usage(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)

    def quota(self, tenant: str) -> int:
        return self.quotas.get(tenant, 0) if tenant else 0

    async def claim(self, tenant: str, namespace: bytes) -> None:
        """Record, durably and off the event loop, that ``namespace`` is ``tenant``'s; call before its
        first block is written. Concurrent claims of one namespace share one append."""
        if not tenant or namespace in self._owner:
            return
        pending = self._pending.get(namespace)
        if pending is None:
            line = (json.dumps({"ns": namespace.hex(), "tenant": tenant}) + "\n").encode()
            loop = asyncio.get_running_loop()
            pending = loop.run_in_executor(self._executor, self._append, line)
            self._pending[namespace] = pending

            def settled(fut: asyncio.Future[None], ns: bytes = namespace) -> None:
                self._pending.pop(ns, None)
                if not fut.cancelled() and fut.exception() is None:
                    self._owner[ns] = tenant

            pending.add_done_callback(settled)
        try:
            await asyncio.shield(pending)
        except OSError as exc:
            raise Unavailable(
                f"tenant ledger {self.path}: cannot record a new namespace: {exc.strerror or exc}"
            ) from None

    async def compact(self, keep: Iterable[bytes] | None = None) -> None:
        """Rewrite the file as one snapshot (of the namespaces in ``keep`` only, when given)."""
        if keep is not None:
            wanted = set(keep)
            self._owner = {ns: t for ns, t in self._owner.items() if ns in wanted}
        snapshot = dict(self._owner)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._rewrite, snapshot)

    def owner(self, key: BlockKey) -> str | None:
        return self._owner.get(key.namespace)

    def owner_of(self, namespace: bytes) -> str | None:
        return self._owner.get(namespace)

    def size(self, key: BlockKey) -> int:
        """The bytes a block counts for (0 when it is not accounted)."""
        tenant = self.owner(key)
        blocks = self._blocks.get(tenant) if tenant else None
        return blocks.get(key, 0) if blocks is not None else 0

    def stored(self, key: BlockKey, size: int) -> list[BlockKey]:
        """Account a stored block; returns the owner's blocks to evict to get back under quota:
        least recently used first, pinned blocks never; the block just stored only when the
        tenant's pinned blocks leave no room for it."""
        tenant = self.owner(key)
        if tenant is None:
            return []
        blocks = self._blocks.setdefault(tenant, OrderedDict())
        old = blocks.pop(key, None)
        blocks[key] = size
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size - (old or 0)
        quota = self.quotas.get(tenant, 0)
        victims: list[BlockKey] = []
        if quota:
            for victim, vsize in list(blocks.items()):
                if self._bytes[tenant] <= quota:
                    break
                if victim == key or self.pinned(victim):
                    continue
                victims.append(victim)
                del blocks[victim]
                self._bytes[tenant] -= vsize
            if self._bytes[tenant] > quota and not self.pinned(key):
                victims.append(key)
                del blocks[key]
                self._bytes[tenant] -= size
        return victims

    def touched(self, keys: list[BlockKey]) -> None:
        for key in keys:
            tenant = self.owner(key)
            blocks = self._blocks.get(tenant) if tenant else None
            if blocks is not None and key in blocks:
                blocks.move_to_end(key)

    def forgot(self, keys: list[BlockKey]) -> None:
        for key in keys:
            tenant = self.owner(key)
            blocks = self._blocks.get(tenant) if tenant else None
            if blocks is not None and (size := blocks.pop(key, None)) is not None:
                self._bytes[tenant] -= size  # type: ignore[index]

    # -- the file (worker threads) ----------------------------------------------------------------------
    def _append(self, line: bytes) -> None:
        self._file.append(line)

    def _rewrite(self, owner: dict[bytes, str]) -> None:
        doc = {"namespaces": {ns.hex(): t for ns, t in owner.items()}}
        self._file.rewrite((json.dumps(doc) + "\n").encode())


def read_ledger(path: Path) -> dict[bytes, str]:
    """The namespace -> tenant map in ``path`` ({} when there is none); :class:`ConfigError` naming the
    file, the line and the damage otherwise."""
    data = read_regular(path, f"tenant ledger {path}", _FIX, _MAX_LEDGER_BYTES)
    if data is None:
        return {}
    if not data:
        raise ConfigError(f"tenant ledger {path}: the file is empty (it is never written empty); {_FIX}")
    lines = data.split(b"\n")
    tail = lines.pop()  # what follows the last newline: b"" in a complete file
    owner: dict[bytes, str] = {}
    for number, line in enumerate(lines, start=1):
        owner.update(_parse_line(path, number, line))
    if tail and not lines:  # one line and no newline: the 0.1 format, or a cut snapshot
        owner.update(_parse_line(path, 1, tail))
    elif tail:
        log.warning(
            "tenant ledger %s: skipping a torn last line (%d bytes, an append cut by a crash; no block "
            "was written after it)",
            path,
            len(tail),
        )
    return owner


def _parse_line(path: Path, number: int, line: bytes) -> dict[bytes, str]:
    where = f"tenant ledger {path}: line {number}"
    try:
        doc = json.loads(line)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"{where} is not valid JSON ({exc}); {_FIX}") from None
    if isinstance(doc, dict) and set(doc) == {"namespaces"} and number == 1:
        entries = doc["namespaces"]
        if not isinstance(entries, dict):
            raise ConfigError(f"{where}: 'namespaces' must map namespace hex to tenant; {_FIX}")
    elif isinstance(doc, dict) and set(doc) == {"ns", "tenant"}:
        entries = {doc["ns"]: doc["tenant"]}
    else:
        raise ConfigError(
            f"{where}: expected {{'namespaces': {{...}}}} (first line only) or "
            f"{{'ns': ..., 'tenant': ...}}, got a {type(doc).__name__}; {_FIX}"
        )
    out: dict[bytes, str] = {}
    for ns_hex, tenant in entries.items():
        try:
            ns = bytes.fromhex(ns_hex) if isinstance(ns_hex, str) else b""
        except ValueError:
            ns = b""
        if len(ns) != NAMESPACE_BYTES:
            raise ConfigError(
                f"{where}: {printable(str(ns_hex), 40)!r} is not a {NAMESPACE_BYTES}-byte namespace "
                f"in hex; {_FIX}"
            )
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"{where}: the tenant of namespace {ns_hex} must be a non-empty string; {_FIX}")
        out[ns] = tenant
    return out


class TenantKeyring:
    """Each namespace's at-rest key: its owner's (the ledger says who owns it; a namespace is
    claimed before its first block is written), ``None`` for namespaces of tenants without one."""

    def __init__(
        self,
        ledger: TenantLedger,
        keys: dict[str, TenantKey],
        sealed: Iterable[str] = (),
        may_open: Callable[[str], bool] = lambda owner: True,
    ) -> None:
        """``sealed``: tenants whose blocks were ever encrypted here; those without a key now are
        locked (their blocks sealed, reported missing, never read or written in clear).
        ``may_open(owner)``: whether the task asking may use ``owner``'s key at all
        (:meth:`ucm_server.authz.Authorizer.may_open`); where not, the blocks are locked to it."""
        self.ledger = ledger
        self.keys = dict(keys)
        self.may_open = may_open
        for tenant in sealed:
            self.keys.setdefault(tenant, LOCKED)

    def key_for(self, namespace: bytes) -> TenantKey | None:
        tenant = self.ledger.owner_of(namespace)
        if not tenant:
            return None
        key = self.keys.get(tenant)
        return key if key is None or self.may_open(tenant) else LOCKED


SEALED_FILE = "sealed_tenants.json"


def tenant_keyring(
    encrypt_tiers: Sequence[str],
    data_dir: Path,
    key_files: Mapping[str, str],
    ledger: TenantLedger | None,
    may_open: Callable[[str], bool],
) -> TenantKeyring | None:
    """The tenants' at-rest keys for the ``encrypt_tiers`` (``None`` when none are named), read now:
    a bad key file stops start-up naming the file, never showing the key. ``key_files``: tenant ->
    path. Start-up also stops where blocks would be stored in clear, or sealed ones left unreadable."""
    sealed_file = data_dir / SEALED_FILE
    if not encrypt_tiers and sealed_file.exists():
        raise ConfigError(
            f"encrypt_tiers is empty, but {sealed_file} lists tenants whose blocks are encrypted at "
            "rest: name the tiers again (or delete those blocks and the file)"
        )
    if key_files and not encrypt_tiers:
        raise ConfigError(
            f"auth_tokens_file gives tenant {sorted(key_files)[0]!r} a key_file, but encrypt_tiers is empty: "
            "its blocks would be stored in clear (name the tiers to encrypt)"
        )
    if not encrypt_tiers:
        return None
    if not key_files or ledger is None:
        raise ConfigError("encrypt_tiers is set, but no tenant in auth_tokens_file has a key_file")
    keys = {t: read_key_file(Path(path), t) for t, path in key_files.items()}
    log.info("at-rest keys for %d tenant(s)", len(keys))
    return TenantKeyring(ledger, keys, remember_sealed(sealed_file, keys), may_open)


def remember_sealed(path: Path, keyed: Iterable[str]) -> set[str]:
    """The tenants whose blocks were ever sealed here (``path``, a JSON list) plus ``keyed``, written
    back durably: a tenant whose key file is later removed stays known as sealed."""
    return remember_names(path, keyed, "sealed tenants", _SEALED_FIX)


_SEALED_FIX = (
    "fix the file (a JSON list of the tenants whose blocks are encrypted at rest); remove a tenant "
    "only once its blocks are deleted"
)
