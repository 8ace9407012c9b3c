"""Protobuf answers turned into plain JSON-able dicts, and those dicts into rich tables for people.

JSON is built by hand rather than with ``MessageToDict`` so the documents are a stable contract:
snake_case keys, integers as numbers (``MessageToDict`` writes uint64 as strings), block keys in the
``<namespace hex>/<key hex>`` form every command accepts, checksums as hex strings (exact in any
JSON reader). Human renderers only ever read these dicts, so both modes show the same facts.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table

from ucm_protocol.text import printable

Json = dict[str, Any]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: 1024-based, three significant digits, like ``ls -h``."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """``3725`` -> ``"1h2m5s"``."""
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    parts = [f"{v}{u}" for v, u in ((days, "d"), (hours, "h"), (minutes, "m")) if v]
    return "".join([*parts, f"{s}s"])


def percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f}%"


def ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def shown(text: str, limit: int = 256) -> str:
    """A string the daemon sent, ready for a rich console: control characters escaped (no ANSI
    sequence from a client reaches the terminal), capped, and rich markup escaped. Human mode only;
    ``--json`` keeps the data as it came."""
    return escape(printable(text, limit, backslashes=False))


# -- stats ------------------------------------------------------------------------------------------
def tier_dict(t: Any) -> Json:
    return {
        "name": t.name,
        "kind": t.kind,
        "blocks": t.blocks,
        "bytes": t.bytes,
        "capacity_bytes": t.capacity_bytes,
        "hits": t.hits,
        "misses": t.misses,
        "hit_rate": ratio(t.hits, t.hits + t.misses),
        "evictions": t.evictions,
        "read_bytes": t.read_bytes,
        "write_bytes": t.write_bytes,
        "errors": t.errors,
        "corrupt": t.corrupt,
        "persistent": t.persistent,
        "shared": t.shared,
        "extra": dict(sorted(t.extra.items())),
    }


def stats_dict(resp: Any, target: str) -> Json:
    return {
        "target": target,
        "version": resp.version,
        "uptime_s": round(resp.uptime_s, 3),
        "store_pipeline": resp.store_pipeline,
        "sessions": resp.sessions,
        "regions": resp.regions,
        "region_bytes": resp.region_bytes,
        "tasks_running": resp.tasks_running,
        "tasks_queued": resp.tasks_queued,
        "lookups": resp.lookups,
        "lookup_keys": resp.lookup_keys,
        "lookup_hits": resp.lookup_hits,
        "lookup_hit_rate": ratio(resp.lookup_hits, resp.lookup_keys),
        "pending_writeback": resp.pending_writeback,
        "pinned_blocks": resp.pinned_blocks,
        "retention_rules": resp.retention_rules,
        "expired_blocks": resp.expired_blocks,
        "tiers": [tier_dict(t) for t in resp.tiers],
        "session_list": [
            {"client_name": s.client_name, "pid": s.pid, "tenant": s.tenant, "age_s": round(s.age_s, 3)}
            for s in resp.session_list
        ],
    }


def stats_summary(stats: Json) -> str:
    return (
        f"[bold]ucm-server {shown(stats['version'])}[/] at {shown(stats['target'])}"
        f" · up {human_duration(stats['uptime_s'])} · pipeline [cyan]{shown(stats['store_pipeline'])}[/]\n"
        f"sessions {stats['sessions']} · regions {stats['regions']} ({human_bytes(stats['region_bytes'])})"
        f" · tasks {stats['tasks_running']} running, {stats['tasks_queued']} queued"
        f" · lookups {stats['lookups']} ({stats['lookup_keys']} keys,"
        f" hit rate {percent(stats['lookup_hit_rate'])})"
        f" · pending write-back {stats['pending_writeback']}"
        f" · pinned {stats['pinned_blocks']} · expired {stats['expired_blocks']}"
    )


def stats_table(stats: Json, rates: dict[str, tuple[float, float]] | None = None) -> Table:
    """One row per tier; ``rates`` (tier -> read, write bytes/s) adds throughput columns (``watch``).

    Kept to about 100 columns (hits, misses, flags are in ``--json``) so it fits a terminal unfolded.
    """
    table = Table(show_edge=False, header_style="bold")
    columns = ["TIER", "BLOCKS", "USED", "CAPACITY", "USE%", "HIT RATE", "EVICTIONS"]
    if rates is not None:
        columns += ["READ/s", "WRITE/s"]
    columns += ["ERRORS", "CORRUPT"]
    for name in columns:
        table.add_column(name, justify="left" if name == "TIER" else "right", no_wrap=True)
    for t in stats["tiers"]:
        cap = t["capacity_bytes"]
        name = shown(t["name"] if t["name"] == t["kind"] else f"{t['name']} ({t['kind']})")
        row = [
            name,
            f"{t['blocks']:,}",
            human_bytes(t["bytes"]),
            human_bytes(cap) if cap else "unlimited",
            percent(ratio(t["bytes"], cap)),
            percent(t["hit_rate"]),
            f"{t['evictions']:,}",
        ]
        if rates is not None:
            read, write = rates.get(t["name"], (0.0, 0.0))
            row += [human_bytes(read), human_bytes(write)]
        row += [_alarm(t["errors"]), _alarm(t["corrupt"])]
        table.add_row(*row)
    return table


def sessions_table(stats: Json) -> Table:
    """One row per attached session; a client's name is its own text, shown escaped and capped."""
    table = Table(show_edge=False, header_style="bold")
    for name in ("CLIENT", "PID", "TENANT", "ATTACHED"):
        table.add_column(name, justify="right" if name == "PID" else "left", no_wrap=True)
    for s in stats.get("session_list", []):
        table.add_row(
            shown(s["client_name"], 64),
            str(s["pid"]),
            shown(s["tenant"] or "-", 64),
            human_duration(s["age_s"]),
        )
    return table


def admission_summary(stats: Json) -> str | None:
    """Whether the daemon keeps up with dumps, and what its admission policies turned away (None when
    it keeps up and every policy is ``always``)."""
    tiers = stats["tiers"]
    parts = []
    if tiers and tiers[0]["extra"].get("store_saturated"):
        parts.append("[bold red]store saturated[/]: clients skip saves")
    for i, t in enumerate(tiers):
        x = t["extra"]
        if "admission_offered" in x:
            where = "at the door" if i == 0 else f"to {shown(t['name'])}"
            parts.append(
                f"admission {where}: {int(x['admission_admitted']):,} of {int(x['admission_offered']):,} "
                f"admitted, {int(x['admission_deferred']):,} turned away "
                f"({human_bytes(int(x['admission_deferred_bytes']))}), "
                f"{int(x['admission_readmitted']):,} written at a later use"
            )
    return " · ".join(parts) or None


def stats_view(stats: Json, rates: dict[str, tuple[float, float]] | None = None) -> RenderableType:
    parts: list[RenderableType] = [stats_summary(stats)]
    if (admission := admission_summary(stats)) is not None:
        parts.append(admission)
    parts.append(stats_table(stats, rates))
    if stats.get("session_list"):
        parts.append(sessions_table(stats))
    return Group(*parts)


def _alarm(n: int) -> str:
    return f"[bold red]{n:,}[/]" if n else "0"


# -- blocks -----------------------------------------------------------------------------------------
def block_dict(info: Any) -> Json:
    ns, key = bytes(info.namespace).hex(), bytes(info.key).hex()
    return {
        "key": f"{ns}/{key}",
        "namespace": ns,
        "digest": key,
        "size": info.size,
        "tiers": list(info.tiers),
        "stored_at": info.stored_at or None,
        "checksum": f"{info.checksum:016x}" if info.has_checksum else None,
        "pinned": info.retention.pinned,
        "expires_at": info.retention.expires_at or None,
        "priority": info.retention.priority,
    }


def retention_text(block: Json) -> str:
    """``pinned``, ``expires <time>``, ``priority N`` (what is set), or ``-``."""
    parts = ["pinned"] if block["pinned"] else []
    if block["expires_at"]:
        parts.append(f"expires {timestamp(block['expires_at'])}")
    if block["priority"]:
        parts.append(f"priority {block['priority']}")
    return ", ".join(parts) or "-"


def timestamp(epoch: float | None) -> str:
    if not epoch:
        return "-"
    return dt.datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


def blocks_table(blocks: list[Json]) -> Table:
    table = Table(show_edge=False, header_style="bold")
    table.add_column("KEY (namespace/key)", no_wrap=True, overflow="fold")
    table.add_column("SIZE", justify="right", no_wrap=True)
    table.add_column("TIERS", no_wrap=True)
    table.add_column("STORED", no_wrap=True)
    table.add_column("RETENTION", no_wrap=True)
    for b in blocks:
        table.add_row(
            b["key"],
            human_bytes(b["size"]),
            ",".join(b["tiers"]),
            timestamp(b["stored_at"]),
            retention_text(b),
        )
    return table


def block_detail(block: Json) -> Table:
    table = Table(show_header=False, show_edge=False, box=None)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    table.add_row("key", block["key"])
    table.add_row("namespace", block["namespace"])
    table.add_row("digest", block["digest"])
    table.add_row("size", f"{human_bytes(block['size'])} ({block['size']:,} bytes)")
    table.add_row("tiers", ", ".join(block["tiers"]))
    table.add_row("stored at", timestamp(block["stored_at"]))
    table.add_row("checksum", block["checksum"] or "none (this tier keeps no checksum)")
    table.add_row("retention", retention_text(block))
    return table
