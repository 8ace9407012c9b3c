"""Eviction policies on a realistic trace (issue #18): LRU against ARC in the Cache tier.

``python -m benchmarks.eviction_bench`` prints a markdown table and writes
``benchmarks/results/eviction.md``. The store is the daemon's own: a real :class:`Pipeline` of a
:class:`CacheTier` (the policy under test) over a :class:`PosixTier` (LRU, files in a temporary
directory, ``durable=False``: the figures are counts, not timings), written through so every byte
that reaches the disk is counted where it is written (the Posix tier's ``write_bytes``).

The trace is what a shared inference service sees: requests that start with one of ``--prefixes``
shared prefixes (system prompts, tenants' documents) drawn from a Zipf distribution, each followed by
a short unique question; mixed with one-off long prompts (``--one-off`` of the requests) that are
never seen again. Each request does what the connector does: a Lookup of its block keys, a Load of
the stored prefix (promoted to the Cache when read from disk), a Dump of the blocks it computed.
One seed, the same trace for every policy.

Figures per policy: the Cache's hit rate over the blocks requested (loads served from memory), the
hit rate of the whole store (memory or disk: what is not recomputed), the same over the blocks of
shared prefixes only, and the bytes written to disk (every recomputed block is written again).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.results_file import publish
from ucm_protocol.keys import BlockKey, Namespace
from ucm_server.store.cache import CacheTier
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.posix import PosixTier

NS = b"eviction-bench!!"


@dataclass(frozen=True, slots=True)
class Trace:
    requests: list[tuple[list[bytes], int]]
    """Each request's block digests and how many of them are its shared prefix (0: a one-off)."""


@dataclass(slots=True)
class Figures:
    policy: str
    blocks: int = 0
    cache_hits: int = 0
    store_hits: int = 0
    shared_blocks: int = 0
    shared_hits: int = 0
    disk_bytes: int = 0


def make_trace(args: argparse.Namespace) -> Trace:
    rng = random.Random(args.seed)
    weights = [1.0 / (rank + 1) ** args.zipf for rank in range(args.prefixes)]
    requests: list[tuple[list[bytes], int]] = []
    for n in range(args.requests):
        if rng.random() < args.one_off:
            digests = [_digest("one-off", n, i) for i in range(args.one_off_blocks)]
            requests.append((digests, 0))
            continue
        (prefix,) = rng.choices(range(args.prefixes), weights)
        digests = [_digest("prefix", prefix, i) for i in range(args.prefix_blocks)]
        digests += [_digest("question", n, i) for i in range(args.question_blocks)]
        requests.append((digests, args.prefix_blocks))
    return Trace(requests)


def _digest(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


async def serve(
    pipeline: Pipeline, cache: CacheTier, namespace: bytes, digests: list[bytes]
) -> tuple[int, int]:
    """One request as the connector serves it: a Lookup of its keys (the daemon's Lookup path), a
    Load of the stored prefix (promoted to the Cache when read from disk), a Dump of the blocks it
    computed. Returns the blocks it found stored (a prefix), and how many of them were in the Cache."""
    block = cache.arena.page_size
    keys = [BlockKey(namespace, d) for d in digests]
    sizes, _ = await pipeline.lookup_presence(Namespace(namespace), digests)
    hit = next((i for i, s in enumerate(sizes) if s is None), len(keys))  # the stored prefix
    in_cache = sum(s is not None for s in await cache.lookup(keys[:hit]))
    if hit:
        outs = [[memoryview(bytearray(block))] for _ in range(hit)]
        results = await pipeline.read_many(list(zip(keys[:hit], outs, strict=True)), owned=True)
        hit = next((i for i, r in enumerate(results) if not r.ok), hit)
    if hit < len(keys):
        data = memoryview(bytes(block))
        await pipeline.write_many([(k, [data]) for k in keys[hit:]], owned=True)
    return hit, min(in_cache, hit)


async def replay(trace: Trace, policy: str, args: argparse.Namespace, root: Path) -> Figures:
    block = args.block_size
    cache = CacheTier(capacity=args.cache_blocks * block, page_size=block, eviction=policy)
    posix = PosixTier(roots=[root], capacity=args.disk_blocks * block, durable=False, direct_io=False)
    pipeline = Pipeline([cache, posix], write_back=False)
    await pipeline.open()
    figures = Figures(policy)
    try:
        for digests, shared in trace.requests:
            hit, in_cache = await serve(pipeline, cache, NS, digests)
            figures.blocks += len(digests)
            figures.store_hits += hit
            figures.cache_hits += in_cache
            figures.shared_blocks += shared
            figures.shared_hits += min(hit, shared)
        figures.disk_bytes = posix.stats().write_bytes
    finally:
        await pipeline.close()
    return figures


def table(rows: list[Figures], args: argparse.Namespace) -> str:
    base = rows[0]
    out = [
        "# Eviction policies on a shared-prefix trace",
        "",
        f"`python -m benchmarks.eviction_bench --requests {args.requests} --seed {args.seed}`: "
        f"{args.requests} requests; {100 * (1 - args.one_off):.0f}% start with one of {args.prefixes} "
        f"shared prefixes of {args.prefix_blocks} blocks (Zipf s={args.zipf}) plus a unique "
        f"{args.question_blocks}-block question, {100 * args.one_off:.0f}% are one-off prompts of "
        f"{args.one_off_blocks} blocks. Cache {args.cache_blocks} blocks (the policy under test) over a "
        f"Posix tier of {args.disk_blocks} blocks (LRU), {args.block_size // 1024} KiB blocks, the "
        "daemon's Pipeline written through.",
        "",
        "| Cache policy | Cache hit rate | store hit rate | shared-prefix hit rate | written to disk "
        "| vs LRU |",
        "|---|---|---|---|---|---|",
    ]
    for f in rows:
        ratio = f.disk_bytes / base.disk_bytes if base.disk_bytes else 0.0
        out.append(
            f"| {f.policy} | {f.cache_hits / f.blocks:.1%} | {f.store_hits / f.blocks:.1%} | "
            f"{f.shared_hits / max(f.shared_blocks, 1):.1%} | {f.disk_bytes / 2**20:.1f} MiB | "
            f"{ratio:.2f}× bytes |"
        )
    return "\n".join(out) + "\n"


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The trace's and the store's arguments (the admission benchmark replays the same trace)."""
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--prefixes", type=int, default=400)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--prefix-blocks", type=int, default=8)
    p.add_argument("--question-blocks", type=int, default=1)
    p.add_argument("--one-off", type=float, default=0.3, help="Share of one-off requests.")
    p.add_argument("--one-off-blocks", type=int, default=48)
    p.add_argument("--cache-blocks", type=int, default=512)
    p.add_argument("--disk-blocks", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=18)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_arguments(p)
    p.add_argument("--no-write", action="store_true", help="Do not write benchmarks/results/eviction.md.")
    args = p.parse_args(argv)
    trace = make_trace(args)
    rows = []
    for policy in ("lru", "arc"):
        with tempfile.TemporaryDirectory(prefix="ucm-evict-") as tmp:
            rows.append(asyncio.run(replay(trace, policy, args, Path(tmp))))
    text = table(rows, args)
    publish("eviction", text, write=not args.no_write)


if __name__ == "__main__":
    main()
