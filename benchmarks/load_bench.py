"""Sustained mixed load: many client processes doing lookups, loads and dumps, every loaded byte checked.

Each of ``--clients`` processes (default 16) owns ``--keys`` block keys and, for ``--seconds``, picks at
random: a Lookup of ``4 x batch`` keys from everyone's key space, a Load of ``batch`` keys (half its own
written ones, half anyone's), or a Dump of ``batch`` of its own keys (a new version each time). A
block's bytes are a function of its key and version, and the version is written in the block's first
8 bytes, so a reader checks every byte it loads without knowing who wrote it: another block's bytes, a
mix of two versions or a torn block would all show. A worker's own written blocks must load OK
(read-your-writes); anyone else's may be MISSING if not written yet, but never wrong.

Reported per op type: count, ops/s, p50 and p99 latency (from the call until its Wait returns), plus
bytes verified, mismatches (bytes that are no version of the block) and stale reads (a worker's own
block loaded intact but older than what it last dumped: read-your-writes broken, see
``tests/hardening/test_promotion_race.py``). ``tests/hardening/test_load.py`` runs this for ~10 s and
asserts zero mismatches and progress by every process.

Run: ``python -m benchmarks.load_bench [--clients 16] [--seconds 30]`` — starts its own daemon (or use
``--target unix:///path``), prints a markdown table and writes ``benchmarks/results/load.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_client.errors import UcmError
from ucm_server.testing.daemon import DaemonProcess

NS = namespace_id(bench="load")
OPS = ("lookup", "load", "dump")
RESULTS = Path(__file__).resolve().parent / "results" / "load.md"


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """One run's shape; every field is a bound, so a run is bounded in time and memory."""

    clients: int = 16
    seconds: float = 10.0
    block_size: int = 16 << 10
    batch: int = 8
    keys: int = 256
    """Keys each client owns (and dumps); lookups and loads range over every client's keys."""
    mix: tuple[float, float, float] = (0.4, 0.3, 0.3)
    """Weights of lookup, load, dump."""
    wait_timeout_s: float = 30.0


@dataclass(slots=True)
class WorkerReport:
    worker: int
    latencies: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    bytes_verified: int = 0
    blocks_verified: int = 0
    mismatches: int = 0
    """Loaded OK yet no version of the block: another block's bytes, a torn or mixed block."""
    stale_reads: int = 0
    """A worker's own block loaded intact but older than the version it last dumped (and was told OK)."""
    stale: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Anything other than a wrong byte that should not happen: a failed dump, an own block missing."""

    def note(self, message: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(message)


@dataclass(frozen=True, slots=True)
class OpSummary:
    op: str
    count: int
    ops_per_s: float
    p50_ms: float
    p99_ms: float


@dataclass(slots=True)
class LoadReport:
    spec: LoadSpec
    wall_s: float
    workers: list[WorkerReport]
    ops: list[OpSummary]

    @property
    def bytes_verified(self) -> int:
        return sum(w.bytes_verified for w in self.workers)

    @property
    def mismatches(self) -> int:
        return sum(w.mismatches for w in self.workers)

    @property
    def stale_reads(self) -> int:
        return sum(w.stale_reads for w in self.workers)

    @property
    def errors(self) -> list[str]:
        return [f"worker {w.worker}: {e}" for w in self.workers for e in w.errors]

    def markdown(self) -> str:
        s = self.spec
        lines = [
            f"{s.clients} client processes, {self.wall_s:.1f} s, blocks of {s.block_size >> 10} KiB, "
            f"batches of {s.batch} (lookups {4 * s.batch} keys), mix lookup/load/dump "
            f"{s.mix[0]:g}/{s.mix[1]:g}/{s.mix[2]:g}",
            "",
            "| op | count | ops/s | p50 ms | p99 ms |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {o.op} | {o.count} | {o.ops_per_s:.0f} | {o.p50_ms:.2f} | {o.p99_ms:.2f} |" for o in self.ops
        ]
        blocks = sum(w.blocks_verified for w in self.workers)
        lines += [
            "",
            f"bytes verified: {self.bytes_verified:,} ({blocks:,} blocks); mismatches: {self.mismatches}; "
            f"stale reads of a worker's own block: {self.stale_reads}; "
            f"other errors: {len(self.errors)}",
        ]
        if self.stale_reads:
            lines += [
                "",
                "A stale read is the known promotion race (a read promoted into the Cache replaced a newer "
                "write): see `tests/hardening/test_promotion_race.py`.",
            ]
        return "\n".join(lines)


def block_bytes(key: bytes, version: int, size: int) -> bytes:
    """Block content: the version (8 bytes, little endian), then bytes derived from key and version."""
    head = version.to_bytes(8, "little")
    return head + hashlib.shake_128(key + head).digest(size - 8)


def check_block(key: bytes, data: bytes) -> bool:
    """Whether ``data`` is exactly some version of block ``key`` (the version is read from it)."""
    version = int.from_bytes(data[:8], "little")
    return version > 0 and data == block_bytes(key, version, len(data))


def _key(worker: int, i: int) -> bytes:
    return key_digest("load-bench", worker, i)


def worker_main(target: str, worker: int, spec: LoadSpec, seed: int, ready: Any, go: Any, out: Any) -> None:
    """One client process: connect, register, wait for ``go``, run the mix for ``spec.seconds``."""
    rep = WorkerReport(worker)
    rng = random.Random(seed * 1000 + worker)
    size, batch = spec.block_size, spec.batch
    versions: dict[int, int] = {}  # own key index -> last version dumped (and reported OK)
    try:
        with UcmClient(target, client_name=f"load-{worker}") as c, SharedBuffer(2 * batch * size) as buf:
            region = c.register(buf)
            ready.put(worker)
            if not go.wait(300):
                rep.note("never told to start")
                return
            deadline = time.monotonic() + spec.seconds
            while time.monotonic() < deadline:
                op = rng.choices(OPS, weights=spec.mix)[0]
                if op == "lookup":
                    keys = [
                        _key(rng.randrange(spec.clients), rng.randrange(spec.keys)) for _ in range(4 * batch)
                    ]
                    t0 = time.perf_counter()
                    c.lookup(NS, keys)
                    rep.latencies[op].append(time.perf_counter() - t0)
                elif op == "dump":
                    idx = rng.sample(range(spec.keys), batch)
                    for j, i in enumerate(idx):
                        buf.buf[j * size : (j + 1) * size] = block_bytes(
                            _key(worker, i), versions.get(i, 0) + 1, size
                        )
                    blocks = [
                        BlockIO(_key(worker, i), (Segment(region, j * size, size),))
                        for j, i in enumerate(idx)
                    ]
                    t0 = time.perf_counter()
                    r = c.wait(c.dump(NS, blocks), spec.wait_timeout_s)
                    rep.latencies[op].append(time.perf_counter() - t0)
                    for j, i in enumerate(idx):
                        if r.states[j] is BlockState.OK:
                            versions[i] = versions.get(i, 0) + 1
                        else:
                            rep.note(f"dump of own key {i}: {r.states[j].name} {r.reasons.get(j, '')}")
                else:
                    own = rng.sample(sorted(versions), min(len(versions), batch // 2))
                    owners = [(worker, i) for i in own]
                    owners += [
                        (rng.randrange(spec.clients), rng.randrange(spec.keys))
                        for _ in range(batch - len(own))
                    ]
                    owners = list(dict.fromkeys(owners))  # one destination per key
                    base = batch * size
                    blocks = [
                        BlockIO(_key(w, i), (Segment(region, base + j * size, size),))
                        for j, (w, i) in enumerate(owners)
                    ]
                    buf.buf[base:] = bytes(batch * size)
                    t0 = time.perf_counter()
                    r = c.wait(c.load(NS, blocks), spec.wait_timeout_s)
                    rep.latencies[op].append(time.perf_counter() - t0)
                    for j, (w, i) in enumerate(owners):
                        state = r.states[j]
                        if state is BlockState.OK:
                            data = bytes(buf.buf[base + j * size : base + (j + 1) * size])
                            got = int.from_bytes(data[:8], "little")
                            want = versions.get(i, 0) if w == worker else got
                            if not check_block(_key(w, i), data) or got > want:
                                rep.mismatches += 1
                                rep.note(f"block {w}/{i} loaded with wrong bytes (version field {got})")
                            elif got < want:  # intact, but an older version than this worker wrote
                                rep.stale_reads += 1
                                if len(rep.stale) < 20:
                                    rep.stale.append(f"own block {i}: version {got}, wrote {want}")
                            else:
                                rep.bytes_verified += size
                                rep.blocks_verified += 1
                        elif (w == worker and i in versions) or state is not BlockState.MISSING:
                            rep.note(f"load of {w}/{i}: {state.name} {r.reasons.get(j, '')}")
    except UcmError as exc:
        rep.note(f"client error: {exc}")
    finally:
        out.put(rep)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def _await_ready(ready: Any, procs: list[Any], timeout_s: float) -> None:
    """Wait until every worker reported ready, failing at once if one died instead."""
    deadline = time.monotonic() + timeout_s
    pending = len(procs)
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{pending} load workers not ready after {timeout_s:g}s")
        try:
            ready.get(timeout=0.5)
            pending -= 1
        except queue.Empty:
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode is not None]
            if dead:
                raise RuntimeError(
                    f"load workers exited before starting (worker, exit code): {dead}"
                ) from None


def run_load(target: str, spec: LoadSpec, seed: int = 0) -> LoadReport:
    """Start ``spec.clients`` processes against ``target``, release them together, collect reports."""
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    procs = [
        ctx.Process(target=worker_main, args=(target, w, spec, seed, ready, go, out), daemon=True)
        for w in range(spec.clients)
    ]
    for p in procs:
        p.start()
    reports: list[WorkerReport] = []
    try:
        _await_ready(ready, procs, timeout_s=180)  # start-up (imports, connect) is not measured
        t0 = time.monotonic()
        go.set()
        reports = [out.get(timeout=spec.seconds + 2 * spec.wait_timeout_s + 60) for _ in procs]
        wall = time.monotonic() - t0
        for p in procs:
            p.join(30)
    finally:
        go.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    reports.sort(key=lambda r: r.worker)
    ops = []
    for op in OPS:
        lat = [x for r in reports for x in r.latencies[op]]
        ops.append(
            OpSummary(
                op,
                len(lat),
                len(lat) / spec.seconds,
                1000 * _percentile(lat, 50),
                1000 * _percentile(lat, 99),
            )
        )
    return LoadReport(spec, wall, reports, ops)


def _tier_notes(target: str) -> str:
    """What the tiers did during the run: evictions, Cache writes refused because every cached block
    was leased by pending write-back (those dumps went straight to disk: the slow tail), and what the
    bounded write-back queue did (written down, kept in the Cache only, backpressure waits)."""
    with UcmClient(target, client_name="load-bench-stats") as c:
        stats = c.stats()
    parts = []
    for t in stats.tiers:
        note = f"{t.name}: {t.evictions} evictions, {t.errors} errors"
        if "rejected_writes" in t.extra:
            note += f", {int(t.extra['rejected_writes'])} writes refused (all blocks leased)"
        parts.append(note)
        wb = {k.removeprefix("writeback_"): v for k, v in t.extra.items() if k.startswith("writeback_")}
        if wb:
            parts.append(
                f"write-back: {int(wb['written'])} written down, {int(wb['skipped'])} kept in the Cache "
                f"only (node saturated), {int(wb['written_through'])} written through, "
                f"{int(wb['backpressure_waits'])} backpressure waits ({wb['backpressure_wait_s']:.1f} s), "
                f"backlog bound {int(wb['max_bytes']) >> 20} MiB"
            )
    return "tiers after the run: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--block-size", type=int, default=16 << 10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--keys", type=int, default=256, help="keys per client")
    parser.add_argument("--cache-capacity", default="32MiB", help="of the daemon this benchmark starts")
    parser.add_argument("--target", help="an already running daemon (default: start one)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    spec = LoadSpec(
        clients=args.clients,
        seconds=args.seconds,
        block_size=args.block_size,
        batch=args.batch,
        keys=args.keys,
    )
    if args.target:
        report = run_load(args.target, spec)
        where, tiers = args.target, _tier_notes(args.target)
    else:
        with tempfile.TemporaryDirectory(prefix="ucm-load-") as tmp:
            d = DaemonProcess(Path(tmp) / "ucm", args=["--cache-capacity", args.cache_capacity])
            with d:
                report = run_load(d.target, spec)
                healthy = d.healthy()
                tiers = _tier_notes(d.target)
            if not healthy:
                print("the daemon was not healthy after the run", file=sys.stderr)
        where = f"a fresh daemon (Cache {args.cache_capacity} | Posix, write-back, 64 KiB Cache pages)"
    table = f"{report.markdown()}\n\n{tiers}"
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m benchmarks.load_bench", *(argv if argv is not None else sys.argv[1:])])
    machine = f"{os.cpu_count()} CPUs, shared with other work"
    args.out.write_text(f"# Mixed load\n\n`{command}` against {where}, on {machine}:\n\n{table}\n")
    for e in [*report.errors[:10], *(s for w in report.workers for s in w.stale)][:20]:
        print(e, file=sys.stderr)
    return 1 if report.mismatches or report.stale_reads or report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
