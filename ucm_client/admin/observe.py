"""Read-only commands: ``health``, ``stats``, ``ls``, ``inspect``, ``watch``.

Each takes the parsed arguments, the :class:`DaemonConnection` and the :class:`Output`, and returns an exit
code; failures are raised and classified by :mod:`ucm_client.admin.errors`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console, Group

from ucm_client.admin import render
from ucm_client.admin.connection import DaemonConnection
from ucm_client.admin.errors import ExitCode, OperationFailed
from ucm_client.admin.output import Mode, Output
from ucm_protocol.errors import NotFound

LIST_PAGE_MAX = 10000


def health(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    """Standard grpc.health.v1 Check; exit 1 unless SERVING (e.g. NOT_SERVING while shutting down)."""
    from grpc_health.v1 import health_pb2

    started = time.monotonic()
    try:
        resp = daemon.call(daemon.health.Check, health_pb2.HealthCheckRequest(service=args.service))
    except NotFound:  # the health service answers NOT_FOUND for a name it does not track
        raise OperationFailed(f"the daemon reports no health status for service {args.service!r}") from None
    latency_ms = (time.monotonic() - started) * 1000
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    data = {
        "target": daemon.target,
        "service": args.service,
        "status": status,
        "latency_ms": round(latency_ms, 2),
    }
    ok = status == "SERVING"

    def human(console: Console) -> None:
        colour = "green" if ok else "red"
        console.print(f"[{colour}]{status}[/] {daemon.target} ({latency_ms:.1f} ms)")

    out.result(data, human, quiet=[])
    if not ok:
        raise OperationFailed(f"daemon at {daemon.target} is {status}, not SERVING")
    return ExitCode.OK


def fetch_stats(daemon: DaemonConnection) -> dict[str, Any]:
    from ucm_protocol.ucm.v1 import ucm_pb2 as pb

    return render.stats_dict(daemon.call(daemon.admin.Stats, pb.StatsRequest()), daemon.target)


def stats(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    data = fetch_stats(daemon)
    out.result(data, lambda c: c.print(render.stats_view(data)))
    return ExitCode.OK


def _pages(
    daemon: DaemonConnection, namespace: bytes, tier: str, page_size: int, token: str
) -> Iterator[Any]:
    from ucm_protocol.ucm.v1 import ucm_pb2 as pb

    while True:
        req = pb.ListBlocksRequest(namespace=namespace, tier=tier, page_size=page_size, page_token=token)
        resp = daemon.call(daemon.admin.ListBlocks, req)
        yield resp
        token = resp.next_page_token
        if not token:
            return


def ls(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    """One page (``--limit``, from ``--page-token``) or, with ``--all``, every page."""
    namespace: bytes = args.namespace or b""
    page_size = LIST_PAGE_MAX if args.all else args.limit
    blocks: list[dict[str, Any]] = []
    next_token, total = "", 0
    for resp in _pages(daemon, namespace, args.tier or "", page_size, args.page_token or ""):
        blocks.extend(render.block_dict(b) for b in resp.blocks)
        next_token, total = resp.next_page_token, resp.total
        if not args.all:
            break
    data = {"blocks": blocks, "total": total, "next_page_token": next_token}

    def human(console: Console) -> None:
        if blocks:
            console.print(render.blocks_table(blocks))
        first = int(args.page_token or 0) + 1 if blocks else 0
        shown = f"{first}-{first + len(blocks) - 1}" if blocks else "0"
        out.info(f"{shown} of {total} blocks")
        if next_token:
            out.info(f"more: add --page-token {next_token} (or --all) to continue")

    out.result(data, human, quiet=[b["key"] for b in blocks])
    return ExitCode.OK


def inspect(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    """Where one block lives, its size, age and checksum; exit 1 if no tier has it."""
    from ucm_protocol.ucm.v1 import ucm_pb2 as pb

    key = args.key
    resp = daemon.call(daemon.admin.Inspect, pb.InspectRequest(namespace=key.namespace, key=key.digest))
    block = render.block_dict(resp.block)
    out.result(block, lambda c: c.print(render.block_detail(block)), quiet=[block["key"]])
    return ExitCode.OK


def watch(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    """Stats every ``--interval`` seconds until ``--count`` samples or Ctrl-C (which exits 0)."""
    previous: tuple[float, dict[str, Any]] | None = None
    n = 0
    try:
        with out.live() as show:
            while args.count is None or n < args.count:
                if n:
                    time.sleep(args.interval)
                now = time.monotonic()
                data = fetch_stats(daemon)
                rates = _rates(previous, now, data)
                previous = (now, data)
                n += 1
                if out.mode is Mode.JSON:
                    out.record({"time": time.time(), "sample": n, **data, "rates": _rates_dict(rates)})
                elif out.mode is Mode.HUMAN:
                    stamp = time.strftime("%H:%M:%S")
                    header = f"[dim]{stamp} · every {args.interval:g}s · Ctrl-C to stop[/]"
                    show(Group(header, render.stats_view(data, rates)))
    except KeyboardInterrupt:
        pass
    return ExitCode.OK


def _rates(
    previous: tuple[float, dict[str, Any]] | None, now: float, data: dict[str, Any]
) -> dict[str, tuple[float, float]]:
    """Read and write bytes per second of each tier since the previous sample (zeros at first)."""
    if previous is None:
        return {t["name"]: (0.0, 0.0) for t in data["tiers"]}
    then, old = previous
    elapsed = max(now - then, 1e-9)
    before = {t["name"]: t for t in old["tiers"]}
    out: dict[str, tuple[float, float]] = {}
    for t in data["tiers"]:
        b = before.get(t["name"])
        if b is None:
            out[t["name"]] = (0.0, 0.0)
            continue
        out[t["name"]] = (
            max(t["read_bytes"] - b["read_bytes"], 0) / elapsed,
            max(t["write_bytes"] - b["write_bytes"], 0) / elapsed,
        )
    return out


def _rates_dict(rates: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    return {
        name: {"read_bytes_per_s": round(r, 1), "write_bytes_per_s": round(w, 1)}
        for name, (r, w) in rates.items()
    }
