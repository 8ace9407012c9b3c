"""Admission policies on two traces: bytes written to the Posix tier, and what is still a hit.

``python -m benchmarks.admission_bench`` prints a markdown table and writes
``benchmarks/results/admission.md``. The store is the daemon's own: a real :class:`Pipeline` of a
:class:`CacheTier` (LRU) over a :class:`PosixTier` (LRU, files in a temporary directory,
``durable=False``: the figures are counts, not timings), written through, with the admission policies
installed exactly as the daemon installs them (:func:`~ucm_server.store.admitting.install_admission`).
Each request does what the connector does: a Lookup of its block keys (the daemon's Lookup path, so
policies see the hits), a Load of the stored prefix (promoted to the Cache when read from disk), a
Dump of the blocks it computed.

Traces (one seed, the same requests for every policy):

* **shared prefixes** — the eviction benchmark's (``benchmarks/eviction_bench.py``): requests start
  with one of ``--prefixes`` shared prefixes drawn from a Zipf distribution plus a short unique
  question, mixed with one-off long prompts (``--one-off`` of the requests). Shared blocks: the prefix.
* **multi-turn sessions** — chat sessions: each starts with one of a few system prompts (Zipf) and
  runs a geometric number of turns (mean ``--turns``; many end after one); a turn's prompt is the
  whole conversation so far plus ``--turn-blocks`` new blocks. ``--active`` sessions interleave.
  Shared blocks: everything a turn's prompt has from before (system prompt and earlier turns).

Figures per policy: bytes written to the Posix tier (and as a ratio of ``always``), the hit rate of
the whole store over all blocks requested and over the shared blocks only, and the Cache's hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import random
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from benchmarks.eviction_bench import Trace, _digest, add_trace_arguments, serve
from benchmarks.eviction_bench import make_trace as shared_prefix_trace
from benchmarks.results_file import publish
from ucm_protocol.keys import BlockKey, Namespace
from ucm_server.store.admission import AdmissionPolicy, Flags, Hashes, key_hashes
from ucm_server.store.admitting import install_admission
from ucm_server.store.cache import CacheTier
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.posix import PosixTier
from ucm_server.store.watch import add_watch

NS = Namespace(b"admission-bench!")


@dataclass(frozen=True, slots=True)
class Policies:
    """The daemon's ``admission_*`` settings, as :func:`install_admission` reads them."""

    label: str
    admission_daemon: str = "always"
    admission_local: str = "always"
    admission_shared: str = "always"
    admission_window_s: float = 1e9
    admission_window_keys: int = 1 << 16
    cache_eviction: str = "lru"


@dataclass(slots=True)
class Figures:
    policies: Policies
    blocks: int = 0
    cache_hits: int = 0
    store_hits: int = 0
    shared_blocks: int = 0
    shared_hits: int = 0
    disk_bytes: int = 0
    deferred: int = 0
    readmitted: int = 0


def session_trace(args: argparse.Namespace) -> Trace:
    """Interleaved multi-turn chat sessions (see the module)."""
    rng = random.Random(args.seed)
    weights = [1.0 / (rank + 1) ** args.zipf for rank in range(args.system_prompts)]
    active: list[tuple[int, list[bytes], int]] = []  # session, its blocks so far, turns left
    next_session = 0
    requests: list[tuple[list[bytes], int]] = []
    while len(requests) < args.requests:
        while len(active) < args.active:
            (system,) = rng.choices(range(args.system_prompts), weights)
            prompt = [_digest("system", system, i) for i in range(args.system_blocks)]
            turns = 1
            while rng.random() > 1 / args.turns:
                turns += 1
            active.append((next_session, prompt, turns))
            next_session += 1
        i = rng.randrange(len(active))
        session, history, left = active[i]
        blocks = history + [_digest("turn", session, len(history), j) for j in range(args.turn_blocks)]
        requests.append((blocks, len(history)))
        if left > 1:
            active[i] = (session, blocks, left - 1)
        else:
            active.pop(i)
    return Trace(requests)


async def replay(trace: Trace, policies: Policies, args: argparse.Namespace, root: Path) -> Figures:
    block = args.block_size
    cache = CacheTier(capacity=args.cache_blocks * block, page_size=block, eviction=policies.cache_eviction)
    posix = PosixTier(roots=[root], capacity=args.disk_blocks * block, durable=False, direct_io=False)
    pipeline = Pipeline([cache, posix], write_back=False)
    admission = install_admission(pipeline, policies)
    pipeline.admission = admission
    await pipeline.open()
    figures = Figures(policies)
    deferral = policies.admission_local.rpartition(":")[2]
    at_eviction = deferral in (EvictionOracle.__name__, EvictionAll.__name__, EvictionSecondUse.__name__)
    evicted = Evictions()
    if at_eviction:
        add_watch(cache, evicted)
    read: set[bytes] = set()
    """Blocks read since they were last dumped (the second-use model's memory)."""
    try:
        for n, (digests, shared) in enumerate(trace.requests):
            hit, in_cache = await serve(pipeline, cache, NS, digests)
            if admission is not None:
                await admission.settle()  # blocks admitted at this use are written down now
            if at_eviction:
                read.update(digests[:hit])
                read.difference_update(digests[hit:])
                wanted = {
                    EvictionOracle.__name__: functools.partial(EvictionOracle.used_after, n),
                    EvictionAll.__name__: lambda _: True,
                    EvictionSecondUse.__name__: read.__contains__,
                }[deferral]
                await write_evicted(posix, evicted.take(), wanted, block)
            figures.blocks += len(digests)
            figures.store_hits += hit
            figures.cache_hits += in_cache
            figures.shared_blocks += shared
            figures.shared_hits += min(hit, shared)
        figures.disk_bytes = posix.stats().write_bytes
        if admission is not None:
            for b in admission.boundaries:
                figures.deferred += b.figures.deferred
                figures.readmitted += b.figures.readmitted
            figures.deferred += admission.door_figures.deferred
    finally:
        await pipeline.close()
    return figures


NOTE = (
    "Two bounds that know the future. Written through, the oracle admits the blocks some later request "
    "asks for again; but the Posix tier needs a block only if it is read after it has left the Cache, "
    "so the true bound defers every write-down to the Cache's eviction and writes a block then only "
    "if a later request asks for it. On the sessions trace a third of the turns are a session's last "
    "(sessions end at random, geometric turns), so no policy can tell which unread blocks will be "
    "read: second use at eviction (a realistic policy in the same model) writes about as little as "
    "the true bound and loses the hits of turns whose blocks were evicted before the next turn read "
    "them; keeping every hit means writing every evicted block the disk lacks (all at eviction). The "
    "eviction rows model a write-back deferred to eviction (blocks live in the Cache alone until "
    "then: a crash loses them); the daemon's write-back writes when a block is dumped."
)

POLICY_ROWS = (
    Policies("always (today)"),
    Policies("second-use below the Cache", admission_local="second-use"),
    Policies("tinylfu below the Cache", admission_local="tinylfu"),
    Policies("second-use at the door", admission_daemon="second-use"),
    Policies("tinylfu at the door", admission_daemon="tinylfu"),
    Policies("second-use below an ARC Cache", admission_local="second-use", cache_eviction="arc"),
    Policies(
        "oracle below the Cache, written through (knows the future)", admission_local=f"{__name__}:Oracle"
    ),
    Policies(
        "oracle at the Cache's eviction (knows the future: the true bound)",
        admission_local=f"{__name__}:EvictionOracle",
    ),
    Policies(
        "all at the Cache's eviction (model: write-back deferred to eviction)",
        admission_local=f"{__name__}:EvictionAll",
    ),
    Policies(
        "second-use at the Cache's eviction (same model)",
        admission_local=f"{__name__}:EvictionSecondUse",
    ),
)


class Oracle(AdmissionPolicy):
    """Admits exactly the blocks some later request asks for again: the fewest bytes that lose no
    hit (a bound for the real policies, not one of them)."""

    name = "oracle"
    reused: ClassVar[set[int]] = set()

    def record(self, h: Hashes) -> None:
        pass

    def admit(self, h: Hashes, victims: Hashes) -> Flags:
        return np.fromiter((int(x) in self.reused for x in h), dtype=bool, count=len(h))

    @classmethod
    def foresee(cls, trace: Trace) -> None:
        """Blocks requested by more than one request of ``trace``."""
        seen: set[bytes] = set()
        again: set[bytes] = set()
        for digests, _ in trace.requests:
            for d in set(digests):
                (again if d in seen else seen).add(d)
        cls.reused = {int(x) for x in key_hashes([NS + d for d in again])}


class Evictions:
    """The keys the Cache let go of (its index watch: in this replay only evictions remove)."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []

    def stored(self, key: bytes) -> None:
        pass

    def stored_many(self, keys: Iterable[bytes]) -> None:
        pass

    def removed(self, key: bytes) -> None:
        self.keys.append(key)

    def cleared(self) -> None:
        pass

    def take(self) -> list[bytes]:
        keys, self.keys = self.keys, []
        return keys


class EvictionOracle(AdmissionPolicy):
    """The true bound: the Posix tier needs a block only when it is read after it has left the
    Cache. Nothing is written below when it is dumped (the write-back deferred until eviction);
    when the Cache evicts a block, it is written down (:func:`write_evicted`) exactly when a later
    request asks for it and the disk does not hold it yet. A bound, not a policy: it knows the
    future, and it keeps every block in the Cache alone until eviction (a crash loses them)."""

    name = "oracle-at-eviction"
    uses: ClassVar[dict[bytes, list[int]]] = {}
    """Each block digest's requests, in order."""

    def record(self, h: Hashes) -> None:
        pass

    def admit(self, h: Hashes, victims: Hashes) -> Flags:
        return np.zeros(len(h), dtype=bool)  # deferred to the Cache's eviction

    @classmethod
    def foresee(cls, trace: Trace) -> None:
        cls.uses = {}
        for n, (digests, _) in enumerate(trace.requests):
            for d in digests:
                cls.uses.setdefault(d, []).append(n)

    @classmethod
    def used_after(cls, now: int, digest: bytes) -> bool:
        """A request after request ``now`` asks for ``digest``."""
        uses = cls.uses.get(digest, [])
        return bisect.bisect_right(uses, now) < len(uses)


class EvictionAll(EvictionOracle):
    """The same model without a policy: every evicted block the disk lacks is written down."""

    name = "all-at-eviction"


class EvictionSecondUse(EvictionOracle):
    """A realistic policy in the same model: deferred until the Cache evicts the block, then
    written down when it was read at least once since it was dumped (a second use)."""

    name = "second-use-at-eviction"


async def write_evicted(
    posix: PosixTier, evicted: list[bytes], wanted: Callable[[bytes], bool], block: int
) -> None:
    """Write down the blocks the Cache evicted that ``wanted`` (by digest) and the disk does not
    hold yet (their bytes: every block of this replay is zeros)."""
    keys = [BlockKey(NS, k[len(NS) :]) for k in dict.fromkeys(evicted) if wanted(k[len(NS) :])]
    if not keys:
        return
    held = await posix.lookup(keys)
    data = memoryview(bytes(block))
    await posix.write_many([(k, [data]) for k, size in zip(keys, held, strict=True) if size is None])


def table(results: dict[str, list[Figures]], args: argparse.Namespace) -> str:
    out = [
        "# Admission policies: bytes written to disk and hit rates",
        "",
        f"`python -m benchmarks.admission_bench --requests {args.requests} --seed {args.seed}`: Cache "
        f"{args.cache_blocks} blocks (LRU) over a Posix tier of {args.disk_blocks} blocks (LRU), "
        f"{args.block_size // 1024} KiB blocks, the daemon's Pipeline written through, admission "
        f"windows of {args.window_keys} keys. Shared prefixes: {100 * (1 - args.one_off):.0f}% of "
        f"requests start with one of {args.prefixes} prefixes of {args.prefix_blocks} blocks (Zipf "
        f"s={args.zipf}) plus a {args.question_blocks}-block question, {100 * args.one_off:.0f}% are "
        f"one-off prompts of {args.one_off_blocks} blocks. Sessions: {args.active} interleaved chats, "
        f"one of {args.system_prompts} system prompts of {args.system_blocks} blocks, {args.turns:g} "
        f"turns on average (geometric), {args.turn_blocks} new blocks a turn.",
        "",
        "| trace | policy | written to Posix | vs always | shared-block hit rate | store hit rate "
        "| Cache hit rate | deferred / readmitted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for trace, rows in results.items():
        base = rows[0]
        for f in rows:
            ratio = f.disk_bytes / base.disk_bytes if base.disk_bytes else 0.0
            out.append(
                f"| {trace} | {f.policies.label} | {f.disk_bytes / 2**20:.1f} MiB | {ratio:.2f}× | "
                f"{f.shared_hits / max(f.shared_blocks, 1):.1%} | {f.store_hits / f.blocks:.1%} | "
                f"{f.cache_hits / f.blocks:.1%} | {f.deferred} / {f.readmitted} |"
            )
    out += ["", NOTE]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_arguments(p)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-blocks", type=int, default=4)
    p.add_argument("--turns", type=float, default=3.0, help="Mean turns of a session.")
    p.add_argument("--turn-blocks", type=int, default=4)
    p.add_argument("--active", type=int, default=64, help="Sessions in progress at once.")
    p.add_argument("--window-keys", type=int, default=1 << 16)
    p.add_argument("--no-write", action="store_true", help="Do not write benchmarks/results/admission.md.")
    args = p.parse_args(argv)
    traces = {"shared prefixes": shared_prefix_trace(args), "multi-turn sessions": session_trace(args)}
    results: dict[str, list[Figures]] = {}
    for name, trace in traces.items():
        rows = results.setdefault(name, [])
        Oracle.foresee(trace)
        EvictionOracle.foresee(trace)
        for row in POLICY_ROWS:
            policies = Policies(
                row.label,
                row.admission_daemon,
                row.admission_local,
                row.admission_shared,
                admission_window_keys=args.window_keys,
                cache_eviction=row.cache_eviction,
            )
            with tempfile.TemporaryDirectory(prefix="ucm-admission-") as tmp:
                rows.append(asyncio.run(replay(trace, policies, args, Path(tmp))))
    publish("admission", table(results, args), write=not args.no_write)


if __name__ == "__main__":
    main()
