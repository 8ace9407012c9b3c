"""Commands that change the store: ``delete``, ``evict``, ``verify``.

They need explicit targets (keys, a byte budget, or ``--all`` confirmed), because an admin tool that
empties a cache on a typo costs an inference fleet its whole prefix cache.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from ucm_client.admin import render
from ucm_client.admin.connection import DaemonConnection
from ucm_client.admin.errors import ExitCode, OperationFailed, UsageError
from ucm_client.admin.output import Output
from ucm_protocol.keys import BlockKey

# Well under the daemon's default max_batch_blocks (65536), so one request never trips the limit.
KEYS_PER_REQUEST = 8192


def read_keys(items: Iterable[str]) -> list[BlockKey]:
    """Keys from the command line; ``-`` reads more from stdin (one per line, as ``ls -q`` prints them)."""
    texts: list[str] = []
    for item in items:
        if item == "-":
            texts.extend(line.strip() for line in sys.stdin if line.strip())
        else:
            texts.append(item)
    keys: list[BlockKey] = []
    for text in texts:
        try:
            keys.append(BlockKey.from_hex(text))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return list(dict.fromkeys(keys))  # drop duplicates, keep order


def by_namespace(keys: list[BlockKey]) -> dict[bytes, list[bytes]]:
    """The daemon's batches carry one namespace each: group keys, then split to request size."""
    groups: dict[bytes, list[bytes]] = {}
    for key in keys:
        groups.setdefault(key.namespace, []).append(key.digest)
    return groups


def _chunks(digests: list[bytes]) -> Iterable[list[bytes]]:
    for i in range(0, len(digests), KEYS_PER_REQUEST):
        yield digests[i : i + KEYS_PER_REQUEST]


def delete(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    """Remove blocks from every tier; exit 1 if some were not there (unless ``--missing-ok``)."""
    from ucm_protocol.ucm.v1 import ucm_pb2 as pb

    keys = read_keys(args.keys)
    if not keys:
        raise UsageError("delete: no keys given (stdin was empty)")
    deleted = 0
    for namespace, digests in by_namespace(keys).items():
        for chunk in _chunks(digests):
            resp = daemon.call(daemon.kv.Delete, pb.DeleteRequest(namespace=namespace, keys=chunk))
            deleted += resp.deleted
    missing = max(len(keys) - deleted, 0)
    data = {"requested": len(keys), "deleted": deleted, "not_found": missing}
    out.result(data, lambda c: c.print(f"deleted {deleted} of {len(keys)} blocks"))
    if missing and not args.missing_ok:
        raise OperationFailed(
            f"{missing} of {len(keys)} blocks were not stored (pass --missing-ok to accept that)"
        )
    return ExitCode.OK


def evict(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    """Free space in one tier: named keys, ``--bytes`` by the tier's policy, or ``--all``."""
    from ucm_protocol.ucm.v1 import ucm_pb2 as pb

    chosen = [
        name
        for name, on in (("KEY", bool(args.keys)), ("--bytes", args.bytes is not None), ("--all", args.all))
        if on
    ]
    if len(chosen) != 1:
        what = " and ".join(chosen) if chosen else "nothing"
        raise UsageError(f"evict needs exactly one target: KEY..., --bytes SIZE or --all (got {what})")
    if args.namespace and not args.all:
        raise UsageError("--namespace only narrows --all (keys already name their namespace)")
    requests: list[Any] = []
    if args.keys:
        for namespace, digests in by_namespace(read_keys(args.keys)).items():
            requests += [
                pb.EvictRequest(tier=args.tier, namespace=namespace, keys=c) for c in _chunks(digests)
            ]
    elif args.bytes is not None:
        if args.bytes <= 0:
            raise UsageError("--bytes must be more than 0")
        requests.append(pb.EvictRequest(tier=args.tier, min_bytes=args.bytes))
    else:
        _confirm_all(args, daemon, out)
        requests.append(pb.EvictRequest(tier=args.tier, namespace=args.namespace or b"", all=True))
    blocks = nbytes = 0
    for req in requests:
        resp = daemon.call(daemon.admin.Evict, req)
        blocks += resp.blocks
        nbytes += resp.bytes
    data = {"tier": args.tier, "blocks": blocks, "bytes": nbytes}
    out.result(
        data, lambda c: c.print(f"evicted {blocks} blocks ({render.human_bytes(nbytes)}) from {args.tier}")
    )
    return ExitCode.OK


def _confirm_all(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> None:
    if args.yes:
        return
    if not sys.stdin.isatty():
        raise UsageError("evict --all asks for confirmation; pass --yes when stdin is not a terminal")
    from ucm_protocol.ucm.v1 import ucm_pb2 as pb

    req = pb.ListBlocksRequest(namespace=args.namespace or b"", tier=args.tier, page_size=1)
    total = daemon.call(daemon.admin.ListBlocks, req).total
    scope = f" of namespace {args.namespace.hex()}" if args.namespace else ""
    if not out.confirm(f"Evict all {total} blocks{scope} from tier {args.tier!r}?"):
        raise OperationFailed("aborted; nothing was evicted")


@dataclass(frozen=True, slots=True)
class CorruptBlockReport:
    """One line of Verify's ``corrupt_keys``: ``"<tier>:<ns hex>/<key hex>: reason"``, parsed."""

    tier: str
    key: str
    reason: str

    @classmethod
    def parse(cls, text: str) -> CorruptBlockReport:
        tier, _, rest = text.partition(":")
        key, _, reason = rest.partition(": ")
        return cls(tier=tier, key=key.strip(), reason=reason.strip())


def verify(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    """Re-read every block of the persistent tiers and check its checksum; exit 1 if any is corrupt."""
    from ucm_protocol.ucm.v1 import ucm_pb2 as pb

    # quarantine: as the help says, a corrupt copy is moved aside (and repaired from another tier)
    req = pb.VerifyRequest(tier=args.tier or "", namespace=args.namespace or b"", quarantine=True)
    daemon.channel()  # fail fast (exit 3) before drawing a progress bar
    corrupt: list[CorruptBlockReport] = []
    checked = total = 0
    with out.progress("verifying") as bar:
        for event in daemon.stream(daemon.admin.Verify, req):
            corrupt += [CorruptBlockReport.parse(s) for s in event.corrupt_keys]
            checked, total = event.checked, event.total
            bar.update(checked, total, f"{len(corrupt)} corrupt" if corrupt else "")
    data = {
        "checked": checked,
        "total": total,
        "corrupt": len(corrupt),
        "corrupt_blocks": [{"tier": c.tier, "key": c.key, "reason": c.reason} for c in corrupt],
    }

    def human(console: Console) -> None:
        scope = f"tier {args.tier}" if args.tier else "the persistent tiers"
        colour = "red" if corrupt else "green"
        console.print(f"checked {checked} blocks in {scope}: [{colour}]{len(corrupt)} corrupt[/]")
        if corrupt:
            table = Table(show_edge=False, header_style="bold")
            table.add_column("TIER", no_wrap=True)
            table.add_column("KEY (namespace/key)", no_wrap=True, overflow="fold")
            table.add_column("REASON")
            for c in corrupt:
                table.add_row(render.shown(c.tier), render.shown(c.key), render.shown(c.reason, 1024))
            console.print(table)
            console.print(
                "corrupt blocks are never served; the daemon moves them aside (a miss, then recompute)"
            )

    out.result(data, human, quiet=[c.key for c in corrupt])
    if corrupt:
        raise OperationFailed(f"{len(corrupt)} corrupt block(s) found")
    return ExitCode.OK
