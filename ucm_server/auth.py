"""Token authentication and tenants.

With ``auth_tokens_file`` set, every KVStore and Admin call must carry ``authorization: Bearer <token>``
metadata (health and reflection stay open, for probes). Each token names a tenant; a tenant's
namespaces are mapped to private ones (a digest of the namespace keyed by the tenant's whole name,
see :func:`tenant_key`), so two tenants never see or touch each other's blocks even if they use the
same namespace, and nothing a tenant sends can name another tenant's namespace. Admin calls need a
token with ``admin: true``.

The tokens file stores SHA-256 digests of tokens, not the tokens (``token`` in clear is accepted for
tests and small setups, with a warning)::

    tokens:
      - token_sha256: "9f86d0…"        # sha256 of the token, hex
        tenant: team-a
        quota: 50GiB                    # optional: bytes this tenant may keep; its own LRU evicts past it
        key_file: /etc/ucm/team-a.key   # optional: its blocks encrypted in the encrypt_tiers (AES-256-GCM)
      - token_sha256: "…"
        tenant: ops
        admin: true

A token without a tenant belongs to the *default tenant*, which under a tokens file is a tenant of
its own like the named ones: its namespaces are private too (keyed by :data:`DEFAULT_TENANT_KEY`, which
no tenant name can produce), so it reaches no named tenant's blocks, not even by naming a namespace
exactly as that tenant's is stored. Without a tokens file the Unix socket's 0600 mode is the access
control, and every caller is an admin of the default tenant, whose namespaces are then stored as
named (one principal: nothing to keep apart). What each principal may call is decided in
:mod:`ucm_server.authz`.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ucm_protocol.errors import ConfigError, Unauthenticated
from ucm_protocol.keys import NAMESPACE_BYTES, Namespace
from ucm_protocol.settings import parse_size, read_yaml_mapping
from ucm_protocol.wire import AUTH_METADATA

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: their tenant ("" = the default tenant), rights and quota."""

    tenant: str = ""
    admin: bool = True
    quota: int = 0  # bytes; 0 = no quota
    key_file: str = ""
    """The tenant's at-rest key file (:mod:`ucm_server.store.encrypted`); its path only, never the key."""
    confined: bool = False
    """The default tenant's namespaces are private as well (a token of a tokens file, without a
    tenant); a named tenant's always are."""

    def scope(self, namespace: bytes) -> Namespace:
        """The namespace as stored: private to the tenant (unchanged only for the default tenant of a
        daemon without tokens)."""
        if self.tenant:
            key = tenant_key(self.tenant)
        elif self.confined:
            key = DEFAULT_TENANT_KEY
        else:
            return Namespace(bytes(namespace))
        mac = hashlib.blake2b(bytes(namespace), digest_size=NAMESPACE_BYTES, key=key)
        return Namespace(mac.digest())


@functools.lru_cache(maxsize=1024)  # tenants come from the tokens file: a handful
def tenant_key(tenant: str) -> bytes:
    """The key that makes ``tenant``'s namespaces private, distinct for every distinct name.

    A name of at most 64 UTF-8 bytes is its own key (blake2b's key size), exactly as in 0.1, so the
    blocks those tenants stored keep their namespaces. keyed blake2b mixes the key's length in, so
    ``"a"`` and ``"a\0"`` differ. A longer name (0.1 cut it to 64 bytes, so two names sharing their
    first 64 bytes shared one namespace) is keyed by a domain-separated 64-byte digest of the whole
    name; :meth:`Authenticator.from_file` refuses a tokens file where two tenants' keys coincide.
    """
    raw = tenant.encode()
    if len(raw) <= 64:
        return raw
    return hashlib.blake2b(raw, digest_size=64, person=b"ucm-tenant-key").digest()


DEFAULT_TENANT_KEY = hashlib.blake2b(b"", digest_size=64, person=b"ucm-default-ten").digest()
"""The key that makes the default tenant's namespaces private under a tokens file: a domain-separated
digest, which no tenant name's key (:func:`tenant_key`) equals (:meth:`Authenticator.from_file`
checks it like any two tenants' keys)."""

ANONYMOUS = Principal()
NETWORK_ANONYMOUS = Principal(admin=False)
"""A TCP peer that showed no credentials (``allow_anonymous_tcp``): the default tenant, never admin."""
current_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "ucm_principal", default=ANONYMOUS
)


class Authenticator:
    def __init__(self, principals: dict[bytes, Principal]) -> None:
        self._by_digest = principals

    @property
    def tenants(self) -> dict[str, Principal]:
        return {p.tenant: p for p in self._by_digest.values()}

    @classmethod
    def from_file(cls, path: Path) -> Authenticator:
        doc = read_yaml_mapping(path, "auth_tokens_file")  # capped, and every failure a ConfigError
        entries = doc.get("tokens") if isinstance(doc, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"auth_tokens_file {path}: expected a non-empty 'tokens:' list")
        principals: dict[bytes, Principal] = {}
        keys: dict[bytes, str] = {DEFAULT_TENANT_KEY: ""}
        key_files: dict[str, str] = {}
        for i, entry in enumerate(entries):
            where = f"auth_tokens_file {path}: tokens[{i}]"
            if not isinstance(entry, dict):
                raise ConfigError(f"{where}: expected a mapping")
            unknown = set(entry) - {"token", "token_sha256", "tenant", "admin", "quota", "key_file"}
            if unknown:
                raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
            if "token_sha256" in entry:
                try:
                    digest = bytes.fromhex(str(entry["token_sha256"]))
                except ValueError:
                    raise ConfigError(f"{where}.token_sha256: not hexadecimal") from None
                if len(digest) != 32:
                    raise ConfigError(f"{where}.token_sha256: expected 64 hex digits")
            elif "token" in entry:
                log.warning("%s holds a token in clear; store token_sha256 instead", where)
                digest = hashlib.sha256(str(entry["token"]).encode()).digest()
            else:
                raise ConfigError(f"{where}: needs token_sha256 (or token)")
            tenant = entry.get("tenant", "")
            if not isinstance(tenant, str):
                raise ConfigError(f"{where}.tenant: expected a string")
            admin = entry.get("admin", False)
            if not isinstance(admin, bool):
                raise ConfigError(f"{where}.admin: expected true or false")
            quota = parse_size(entry.get("quota", 0), f"{where}.quota")
            key_file = entry.get("key_file", "")
            if not isinstance(key_file, str) or (key_file and not tenant):
                raise ConfigError(f"{where}.key_file: expected a path, and only for a named tenant")
            if key_file and key_files.setdefault(tenant, key_file) != key_file:
                raise ConfigError(f"{where}.key_file: tenant {tenant!r} names two key files")
            if digest in principals:
                raise ConfigError(f"{where}: the same token appears twice")
            if tenant and keys.setdefault(tenant_key(tenant), tenant) != tenant:
                raise ConfigError(f"{where}.tenant: its namespaces would be another tenant's; rename it")
            principals[digest] = Principal(tenant, admin, quota, key_file, confined=True)
        for digest, p in principals.items():  # every token of a tenant carries its key file
            if p.tenant in key_files and not p.key_file:
                principals[digest] = Principal(p.tenant, p.admin, p.quota, key_files[p.tenant], confined=True)
        return cls(principals)

    def authenticate(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Principal:
        value = next((v for k, v in metadata or () if k == AUTH_METADATA), None)
        if value is None:
            raise Unauthenticated(
                "this daemon requires a token: send 'authorization: Bearer <token>' (UCM_TOKEN)"
            )
        text = value.decode() if isinstance(value, bytes) else value
        scheme, _, token = text.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
        digest = hashlib.sha256(token.strip().encode()).digest()
        for known, principal in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return principal
        raise Unauthenticated("unknown token")
