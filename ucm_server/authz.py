"""Authorization: who may call what, and which blocks a call reaches — one rule, decided here.

Every KVStore and Admin call passes :meth:`Authorizer.admit` before its handler runs (the server
interceptor calls it, the one spot every RPC goes through), and every namespace a call names is
resolved by :meth:`Authorizer.namespace` (a data call) or :func:`store_namespace` (an Admin call).
The rule, in full:

* **Every RPC has a row** in :data:`RULES`. A ``ucm.v1`` method without one is refused
  (``PERMISSION_DENIED``): a method added to the proto reaches nothing until someone decides who
  may call it (and the authorization matrix test fails until it has a row there too).
* **Who is calling.** With a tokens file, every call carries a token (``UNAUTHENTICATED``
  otherwise) naming a tenant, possibly the default tenant ``""``, and an admin flag. Without one,
  a Unix-socket peer is the daemon's one local principal (an admin of the default tenant: the
  socket's 0600 mode is the access control), and a TCP peer without credentials
  (``allow_anonymous_tcp``) is that default tenant without admin rights.
* **A principal reaches only its own tenant's namespaces.** A data call's namespace is mapped into
  the caller's tenant (:meth:`~ucm_server.auth.Principal.scope`); under a tokens file that holds for
  the default tenant too, so naming a namespace exactly as another tenant's is stored reaches a
  namespace of one's own, which holds nothing of theirs. The answer is then the one for any empty
  namespace (missing, not present, nothing deleted), never a refusal: a refusal would tell the caller
  that the other tenant uses that namespace. As a second line, a resolved namespace the tenant
  ledger records as another tenant's is refused (``PERMISSION_DENIED``).
* **Sessions are their tenant's.** Calls that name a session (tasks, regions) are refused
  (``PERMISSION_DENIED``) for a session attached by another tenant.
* **Memory is registered over the Unix socket only** (a TCP peer streams bytes with
  GetBlocks/PutBlocks instead).
* **Admin operates the store**: Stats, ListBlocks, Inspect, Evict and Verify need an admin
  principal; they name blocks as stored and answer names, sizes and figures, never block bytes.
  An admin's data calls are confined to its own tenant like anyone's.
* **Decryption is for the owner.** A tenant's sealed blocks are opened only for a data call of that
  tenant, or inside the daemon's own work whose bytes reach no caller (write-back, promotion, an
  admin's verify-and-repair): :meth:`Authorizer.may_open`.
"""

from __future__ import annotations

import contextvars
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from ucm_protocol.errors import PermissionDenied
from ucm_protocol.keys import Namespace, check_namespace
from ucm_server.auth import ANONYMOUS, NETWORK_ANONYMOUS, Authenticator, Principal, current_principal


class Access(enum.Enum):
    """What a call names, and so what it can reach."""

    SESSION = "session"
    """A session of the caller's tenant (Attach makes one; tasks and regions belong to it)."""
    DATA = "data"
    """Blocks by namespace and key, mapped into the caller's tenant."""
    STORE = "store"
    """The store as an operator sees it: blocks as stored, figures; never block bytes."""


@dataclass(frozen=True, slots=True)
class Rule:
    access: Access
    admin: bool = False
    """Only an admin principal may call it."""
    local_only: bool = False
    """Only over the Unix socket (it hands the daemon the caller's memory)."""


_SESSION = Rule(Access.SESSION)
_DATA = Rule(Access.DATA)
_STORE = Rule(Access.STORE, admin=True)

RULES: Mapping[str, Rule] = MappingProxyType(
    {
        "/ucm.v1.KVStore/Attach": _SESSION,
        "/ucm.v1.KVStore/RegisterRegion": Rule(Access.SESSION, local_only=True),
        "/ucm.v1.KVStore/UnregisterRegion": _SESSION,
        "/ucm.v1.KVStore/Lookup": _DATA,
        "/ucm.v1.KVStore/Load": _DATA,
        "/ucm.v1.KVStore/Dump": _DATA,
        "/ucm.v1.KVStore/Prefetch": _DATA,
        "/ucm.v1.KVStore/Wait": _SESSION,
        "/ucm.v1.KVStore/Check": _SESSION,
        "/ucm.v1.KVStore/Cancel": _SESSION,
        "/ucm.v1.KVStore/Delete": _DATA,
        "/ucm.v1.KVStore/SetRetention": _DATA,
        "/ucm.v1.KVStore/GetBlocks": _DATA,
        "/ucm.v1.KVStore/PutBlocks": _DATA,
        "/ucm.v1.Admin/Stats": _STORE,
        "/ucm.v1.Admin/ListBlocks": _STORE,
        "/ucm.v1.Admin/Inspect": _STORE,
        "/ucm.v1.Admin/Evict": _STORE,
        "/ucm.v1.Admin/Verify": _STORE,
    }
)
"""Every ``ucm.v1`` RPC by its full gRPC method name: what it names and who may call it."""

GUARDED = ("/ucm.v1.",)
"""Method prefixes this module decides for (health and reflection stay open, for probes)."""


@dataclass(frozen=True, slots=True)
class Grant:
    """An admitted call: who calls, under which rule."""

    principal: Principal
    rule: Rule


current_grant: contextvars.ContextVar[Grant | None] = contextvars.ContextVar("ucm_grant", default=None)
"""The admitted call of this task; ``None`` for the daemon's own work and in-process callers."""


class Owners(Protocol):
    """Who owns a stored namespace (:class:`ucm_server.tenants.TenantLedger`)."""

    def owner_of(self, namespace: bytes) -> str | None: ...


class Authorizer:
    def __init__(
        self,
        authenticator: Authenticator | None,
        *,
        tcp_anonymous: bool = False,
        owners: Owners | None = None,
    ) -> None:
        """``tcp_anonymous``: the TCP listener checks no credentials (its peers are
        :data:`~ucm_server.auth.NETWORK_ANONYMOUS`); ``owners``: the tenant ledger, for the second
        line of :meth:`namespace`."""
        self._auth = authenticator
        self._tcp_anonymous = tcp_anonymous
        self.owners = owners

    def admit(
        self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None, *, local: bool
    ) -> Grant | None:
        """Decide whether the call may run at all and as whom; raises ``Unauthenticated`` or
        ``PermissionDenied`` naming why. ``local``: it came over the Unix socket. ``None`` for a
        method this module does not guard (health, reflection)."""
        if not method.startswith(GUARDED):
            return None
        name = method.rsplit("/", 1)[-1]
        rule = RULES.get(method)
        if rule is None:
            raise PermissionDenied(f"{name}: no authorization rule for this method; it is refused")
        principal = self._principal(metadata, local)
        if rule.admin and not principal.admin:
            if principal is NETWORK_ANONYMOUS:
                raise PermissionDenied(
                    f"{name} is an Admin call: not allowed to an anonymous TCP peer (the daemon needs "
                    "auth_tokens_file or tls_client_ca for remote admins; or use the Unix socket)"
                )
            raise PermissionDenied(f"{name} needs an admin token")
        if rule.local_only and not local:
            raise PermissionDenied(
                "memory registration needs a local Unix-socket client; over TCP use GetBlocks/PutBlocks"
            )
        return Grant(principal, rule)

    def _principal(self, metadata: Sequence[tuple[str, str | bytes]] | None, local: bool) -> Principal:
        if self._auth is not None:
            return self._auth.authenticate(metadata)
        if self._tcp_anonymous and not local:
            return NETWORK_ANONYMOUS
        return ANONYMOUS

    def namespace(self, namespace: bytes) -> Namespace:
        """The namespace a data call names, as stored: checked, mapped into the caller's tenant, and
        never a namespace the ledger records as another tenant's."""
        principal = current_principal.get()
        stored = principal.scope(check_namespace(namespace))
        owner = self.owners.owner_of(stored) if self.owners is not None else None
        if owner is not None and owner != principal.tenant:
            raise PermissionDenied("this namespace belongs to another tenant")
        return stored

    def may_open(self, owner: str) -> bool:
        """Whether this task may decrypt a block of ``owner``'s: a data call only for its own
        tenant; the daemon's own work and an admin's upkeep (whose bytes reach no caller) may."""
        grant = current_grant.get()
        if grant is None or grant.rule.access is Access.STORE:
            return True
        return grant.principal.tenant == owner

    @staticmethod
    def check_session(session_tenant: str, session_id: str) -> None:
        """A session is its tenant's: another tenant naming it is refused."""
        if session_tenant != current_principal.get().tenant:
            raise PermissionDenied(f"session {session_id[:8]} belongs to another tenant")


def enter(grant: Grant | None) -> None:
    """Make ``grant`` this task's (its principal is what the engine reads)."""
    if grant is not None:
        current_grant.set(grant)
        current_principal.set(grant.principal)


def store_namespace(namespace: bytes) -> Namespace:
    """A namespace as an Admin call names it: as stored (checked, not mapped)."""
    return check_namespace(namespace)
