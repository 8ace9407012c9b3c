"""I/O classes: a Load from the Posix tier while the daemon is busy with background writes.

``python -m benchmarks.io_classes`` starts one daemon (Cache | Posix, write-back, durable) and
measures, in one run, the latency of a 16-block Load whose blocks sit in the Posix tier only:

* **idle** — nothing else runs;
* **busy** — ``--dumpers`` client processes dump fresh blocks as fast as the daemon takes them and the
  write-back backlog holds at least ``--min-backlog`` bytes (it is sampled at every probe and reported).

Each probe loads blocks never read before (pre-written with ``wait_durable``, then evicted from the
Cache), so every probe reads the disk, not the Cache or the page cache. The figures are p50 and p99 of
the probes, and the busy ones as a ratio of the idle ones: how long a request waits for its prefix
when background work shares the daemon. Also reported: what the dumpers stored meanwhile and what
write-back wrote down (background work must keep progressing while loads go first).

Writes ``benchmarks/results/io_classes.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from benchmarks.results_file import publish
from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

NS = namespace_id(bench="io-classes")
PROBE_BLOCKS = 16


@dataclass(frozen=True, slots=True)
class Spec:
    block_size: int
    probes: int
    dumpers: int
    dump_blocks: int
    min_backlog: int
    gap_s: float
    rounds: int
    settle_s: float
    warmup: int


@dataclass(slots=True)
class Phase:
    name: str
    seconds: list[float] = field(default_factory=list)
    backlog: list[int] = field(default_factory=list)
    """Write-back bytes pending when each probe started."""

    def p(self, q: int) -> float:
        s = sorted(self.seconds)
        if len(s) == 1:
            return s[0]
        return statistics.quantiles(s, n=100, method="inclusive")[q - 1]


def _probe_key(probe: int, i: int) -> bytes:
    return key_digest("io-classes-probe", probe, i)


def _writeback(client: UcmClient) -> dict[str, float]:
    top = client.stats().tiers[0]
    return {k.removeprefix("writeback_"): v for k, v in top.extra.items() if k.startswith("writeback_")}


def prewrite(client: UcmClient, target: str, spec: Spec, nsets: int) -> None:
    """Store every probe's blocks durably, then evict them from the Cache: they are in Posix only."""
    size = spec.block_size
    with SharedBuffer(PROBE_BLOCKS * size) as buf:
        buf.buf[:] = os.urandom(PROBE_BLOCKS * size)
        region = client.register(buf)
        for probe in range(nsets):
            blocks = [
                BlockIO(_probe_key(probe, i), (Segment(region, i * size, size),)) for i in range(PROBE_BLOCKS)
            ]
            r = client.wait(client.dump(NS, blocks, wait_durable=True), 120)
            if any(s is not BlockState.OK for s in r.states):
                raise RuntimeError(f"pre-writing probe {probe} failed: {r.reasons}")
        client.unregister(region)
    with grpc.insecure_channel(target) as channel:
        rpc.AdminStub(channel).Evict(pb.EvictRequest(tier="Cache", all=True), timeout=60)
    deadline = time.monotonic() + 300
    while client.stats().tiers[0].extra.get("prefault_pending_bytes", 0) > 0:  # the arena faulted in
        if time.monotonic() > deadline:
            raise RuntimeError("the Cache arena was not faulted in after 300 s")
        time.sleep(0.1)


def run_probes(client: UcmClient, spec: Spec, first: int, count: int, phase: Phase) -> None:
    size = spec.block_size
    with SharedBuffer(PROBE_BLOCKS * size) as buf:
        region = client.register(buf)
        for probe in range(first, first + count):
            blocks = [
                BlockIO(_probe_key(probe, i), (Segment(region, i * size, size),)) for i in range(PROBE_BLOCKS)
            ]
            phase.backlog.append(int(_writeback(client).get("bytes_pending", 0)))
            t0 = time.perf_counter()
            r = client.wait(client.load(NS, blocks), 120)
            phase.seconds.append(time.perf_counter() - t0)
            if any(s is not BlockState.OK for s in r.states):
                raise RuntimeError(f"probe {probe} did not load: {r.reasons}")
            time.sleep(spec.gap_s)
        client.unregister(region)


def dumper_main(target: str, worker: int, spec: Spec, go: Any, stop: Any, out: Any) -> None:
    """One client dumping fresh blocks while ``go`` is set, until ``stop``; reports blocks stored,
    dumps and the seconds they took."""
    size, n = spec.block_size, spec.dump_blocks
    stored = dumps = 0
    waited = 0.0
    with UcmClient(target, client_name=f"dumper-{worker}") as c, SharedBuffer(n * size) as buf:
        buf.buf[:] = os.urandom(n * size)
        region = c.register(buf)
        batch = 0
        while not stop.is_set():
            if not go.wait(0.05):
                continue
            blocks = [
                BlockIO(key_digest("io-classes-dump", worker, batch, i), (Segment(region, i * size, size),))
                for i in range(n)
            ]
            t0 = time.perf_counter()
            r = c.wait(c.dump(NS, blocks), 300)
            waited += time.perf_counter() - t0
            stored += sum(s is BlockState.OK for s in r.states)
            dumps += 1
            batch += 1
    out.put((worker, stored, dumps, waited))


@dataclass(slots=True)
class Background:
    stored_blocks: int = 0
    dumps: int = 0
    dump_seconds: float = 0.0
    written_down: int = 0
    busy_s: float = 0.0
    """Seconds the dumpers ran, all rounds together."""


def _until(what: str, done: Callable[[], bool], procs: list[Any], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting until {what}")
        if any(p.exitcode is not None for p in procs):
            raise RuntimeError("a dumper exited early")
        time.sleep(0.05)


def measure(client: UcmClient, target: str, spec: Spec, idle: Phase, busy: Phase) -> Background:
    """``spec.rounds`` rounds of idle probes (dumpers paused, backlog drained), then busy probes
    (dumpers running, backlog at least ``spec.min_backlog``): a machine whose speed drifts during
    the run (other work on it) slows both phases alike."""
    ctx = mp.get_context("spawn")
    go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=dumper_main, args=(target, w, spec, go, stop, out), daemon=True)
        for w in range(spec.dumpers)
    ]
    for p in procs:
        p.start()
    bg = Background()
    before = _writeback(client).get("written", 0)
    per_round = spec.probes // spec.rounds
    run_probes(client, spec, 2 * spec.probes, spec.warmup, Phase("warm-up"))  # first-use costs, not counted
    try:
        for n in range(spec.rounds):
            _until("the backlog drained", lambda: not _writeback(client).get("queue_depth", 0), procs)
            time.sleep(spec.settle_s)  # the dumpers' last calls answered, the machine quiet again
            run_probes(client, spec, 2 * n * per_round, per_round, idle)
            go.set()
            started = time.monotonic()
            _until(
                f"the backlog held {spec.min_backlog} bytes",
                lambda: _writeback(client).get("bytes_pending", 0) >= spec.min_backlog,
                procs,
            )
            run_probes(client, spec, (2 * n + 1) * per_round, per_round, busy)
            go.clear()
            bg.busy_s += time.monotonic() - started
    finally:
        go.clear()
        stop.set()
        for _ in procs:
            _, stored, dumps, waited = out.get(timeout=600)
            bg.stored_blocks += stored
            bg.dumps += dumps
            bg.dump_seconds += waited
        for p in procs:
            p.join(30)
    bg.written_down = int(_writeback(client).get("written", 0) - before)
    return bg


def table(
    spec: Spec, idle: Phase, busy: Phase, bg: Background, argv: list[str], load: tuple[float, float]
) -> str:
    mib = spec.block_size / 2**20
    command = " ".join(["python -m benchmarks.io_classes", *argv])
    low, mid = min(busy.backlog) / 2**30, statistics.median(busy.backlog) / 2**30
    rows = [
        "# I/O classes: a Load from disk behind background writes",
        "",
        f"`{command}`: one daemon (Cache | Posix, write-back, durable), {os.cpu_count()} CPUs shared "
        f"with other work. A probe loads {PROBE_BLOCKS} blocks of {mib:g} MiB that sit in the Posix "
        f"tier only (never read before), {spec.probes} probes per phase in {spec.rounds} rounds of "
        f"idle (nothing else runs, the backlog drained) then busy. Busy: {spec.dumpers} clients "
        f"dump {spec.dump_blocks}-block batches of fresh blocks throughout, and the write-back backlog "
        f"holds {low:.2f} GiB at least (median {mid:.2f} GiB) when a probe starts.",
        "",
        "| phase | probes | Load p50 | Load p99 | p50 vs idle | p99 vs idle |",
        "|---|---|---|---|---|---|",
    ]
    for ph in (idle, busy):
        rows.append(
            f"| {ph.name} | {len(ph.seconds)} | {1000 * ph.p(50):.1f} ms | {1000 * ph.p(99):.1f} ms | "
            f"{ph.p(50) / idle.p(50):.2f}× | {ph.p(99) / idle.p(99):.2f}× |"
        )
    per_round = max(len(idle.seconds) // spec.rounds, 1)
    cuts = [slice(n * per_round, (n + 1) * per_round) for n in range(spec.rounds)]
    """Each round's probes, the same places in both phases."""

    def round_figures(ph: Phase, n: int) -> str:
        ms = [1000 * x for x in ph.seconds[cuts[n]]]
        return f"{statistics.median(ms):.0f}/{max(ms):.0f}" if ms else "-"

    rounds = "; ".join(
        f"{n + 1}: {round_figures(idle, n)} idle, {round_figures(busy, n)} busy" for n in range(spec.rounds)
    )
    paired = [
        statistics.median(busy.seconds[cut]) / statistics.median(idle.seconds[cut])
        for cut in cuts
        if idle.seconds[cut] and busy.seconds[cut]
    ]
    gib = bg.stored_blocks * spec.block_size / 2**30
    rows += [
        "",
        f"Per round, p50/max ms (a round whose idle probes are slow too, the disk slowed by what came "
        f"before, lifts both phases' tails alike): {rounds}.",
        "",
        f"Each round's busy p50 ÷ its own idle p50 (a pairing that a slow stretch of the disk, lasting "
        f"seconds, cannot put on one phase only): median {statistics.median(paired):.2f}× "
        f"({', '.join(f'{x:.2f}' for x in paired)}).",
        "",
        f"Background work in the busy phases ({bg.busy_s:.0f} s): the dumpers stored {gib:.1f} GiB "
        f"({bg.stored_blocks * spec.block_size / 2**20 / bg.busy_s:.0f} MiB/s, mean dump "
        f"{1000 * bg.dump_seconds / max(bg.dumps, 1):.0f} ms) and write-back wrote down "
        f"{bg.written_down * spec.block_size / 2**30:.1f} GiB.",
        "",
        f"The machine's 1-minute load average was {load[0]:.1f} when the run began and {load[1]:.1f} "
        "when it ended (other work shares the CPUs and the disk: the idle tail is theirs as much as ours).",
    ]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument(
        "--probes",
        type=int,
        default=200,
        help="Loads per phase, all rounds together (a p99 of 60 would be their maximum: noise).",
    )
    p.add_argument("--rounds", type=int, default=4, help="Idle-then-busy rounds.")
    p.add_argument("--warmup", type=int, default=5, help="Loads before the first round, not counted.")
    p.add_argument("--dumpers", type=int, default=8)
    p.add_argument("--dump-blocks", type=int, default=16, help="Blocks per dump.")
    p.add_argument("--min-backlog", type=int, default=1 << 30, help="Write-back bytes pending when busy.")
    p.add_argument("--cache-capacity", default="3GiB")
    p.add_argument("--writeback-max-bytes", default="1536MiB")
    p.add_argument("--gap-s", type=float, default=0.05, help="Pause between probes.")
    p.add_argument("--settle-s", type=float, default=1.0, help="Pause before the idle probes of a round.")
    p.add_argument("--daemon-arg", action="append", default=[], help="Extra ucm-server argument.")
    p.add_argument("--samples", action="store_true", help="Print every probe's latency (stderr).")
    p.add_argument("--no-write", action="store_true", help="Do not write benchmarks/results/io_classes.md.")
    args = p.parse_args(argv)
    spec = Spec(
        args.block_size,
        args.probes - args.probes % args.rounds,
        args.dumpers,
        args.dump_blocks,
        args.min_backlog,
        args.gap_s,
        args.rounds,
        args.settle_s,
        args.warmup,
    )
    daemon_args = [
        "--cache-capacity",
        args.cache_capacity,
        "--writeback-max-bytes",
        args.writeback_max_bytes,
        "--write-mode",
        "write-back",
        *args.daemon_arg,
    ]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ucm-io-classes-", dir=os.environ.get("UCM_BENCH_DIR")) as tmp:
        with DaemonProcess(Path(tmp) / "ucm", args=daemon_args) as daemon:
            with UcmClient(daemon.target, client_name="io-classes-probe") as client:
                prewrite(client, daemon.target, spec, 2 * spec.probes + spec.warmup)
                idle, busy = Phase("idle"), Phase("busy")
                bg = measure(client, daemon.target, spec, idle, busy)
    if args.samples:
        for ph in (idle, busy):
            print(ph.name, "ms:", " ".join(f"{1000 * x:.0f}" for x in ph.seconds), file=sys.stderr)
    load = (load_before, os.getloadavg()[0])
    text = table(spec, idle, busy, bg, argv if argv is not None else sys.argv[1:], load)
    publish("io_classes", text, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
