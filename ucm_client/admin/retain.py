"""Commands that change how long blocks are kept: ``pin``, ``unpin``, ``ttl``, ``priority``.

Each sends ``KVStore.SetRetention`` for the keys given (arguments or ``-`` for stdin, grouped by
namespace, a bounded number per request) and reports how many stored blocks it applied to. Keys
stored nowhere are counted and make the command exit 1 (unless ``--missing-ok``), as ``delete``
does; tiers that cannot hold a pin are named on stderr (``--require-all-tiers`` refuses instead).
"""

from __future__ import annotations

import argparse

from ucm_client.admin.connection import DaemonConnection
from ucm_client.admin.errors import ExitCode, OperationFailed, UsageError
from ucm_client.admin.operate import _chunks, by_namespace, read_keys
from ucm_client.admin.output import Output


def pin(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    """Pin blocks (never evicted, in every tier that can hold a pin), optionally with a priority."""
    return _change(args, daemon, out, "pinned", pin=True)


def unpin(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    return _change(args, daemon, out, "unpinned", unpin=True)


def ttl(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    """Expire blocks SECONDS from now (``never``: remove the expiry)."""
    if not args.seconds:
        return _change(args, daemon, out, "no longer expire", clear_ttl=True)
    return _change(args, daemon, out, f"expire in {args.seconds:g}s", ttl_s=args.seconds)


def priority(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    """Set the eviction priority (-100..100; lower is evicted first, 0 is the default)."""
    return _change(args, daemon, out, f"priority {args.value}", set_priority=True, priority=args.value)


def _change(
    args: argparse.Namespace, daemon: DaemonConnection, out: Output, done: str, **fields: object
) -> ExitCode:
    from ucm_protocol.ucm.v1 import ucm_pb2 as pb

    keys = read_keys(args.keys)
    if not keys:
        raise UsageError(f"{args.command}: no keys given (stdin was empty)")
    if getattr(args, "priority", None) is not None and "pin" in fields:
        fields.update(set_priority=True, priority=args.priority)
    strict = bool(getattr(args, "require_all_tiers", False))
    applied = missing = 0
    gaps: list[str] = []
    for namespace, digests in by_namespace(keys).items():
        for chunk in _chunks(digests):
            request = pb.SetRetentionRequest(
                namespace=namespace,
                keys=chunk,
                require_all_tiers=strict,
                **fields,  # type: ignore[arg-type]
            )
            resp = daemon.call(daemon.kv.SetRetention, request)
            applied += resp.applied
            missing += resp.missing
            gaps += [g for g in resp.not_enforced if g not in gaps]
    for gap in gaps:
        out.warn(f"not held in {gap}")
    data = {"requested": len(keys), "applied": applied, "not_found": missing, "not_enforced": gaps}
    out.result(data, lambda c: c.print(f"{applied} of {len(keys)} blocks {done}"))
    if missing and not args.missing_ok:
        raise OperationFailed(
            f"{missing} of {len(keys)} blocks are not stored (pass --missing-ok to accept that)"
        )
    return ExitCode.OK
