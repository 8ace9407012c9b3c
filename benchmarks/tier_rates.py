"""What the at-rest benchmarks share (encryption, compression): their command line, and dump and
load throughput of one tier, best of several runs of a batch of identical blocks."""

from __future__ import annotations

import argparse
import time

from ucm_protocol.keys import BlockKey
from ucm_server.store.base import Tier


def parser(doc: str | None, blocks: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=blocks)
    p.add_argument("--block-size", type=int, default=2 << 20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-write", action="store_true")
    return p


async def tier_rates(
    tier: Tier, namespace: bytes, data: memoryview, blocks: int, repeats: int, *, exact: bool = True
) -> tuple[float, float, int]:
    """(dump B/s, load B/s, bytes the tier holds after a dump): ``blocks`` copies of ``data``
    written as one batch, then read back as one (compared with ``data`` when ``exact``)."""
    size = data.nbytes
    best_w = best_r = 0.0
    stored = 0
    for r in range(repeats):
        keys = [
            BlockKey(namespace, r.to_bytes(4, "little") + i.to_bytes(28, "little")) for i in range(blocks)
        ]
        t = time.perf_counter()
        results = await tier.write_many([(k, [data]) for k in keys])
        best_w = max(best_w, blocks * size / (time.perf_counter() - t))
        assert all(x.ok for x in results)
        stored = tier.stats().bytes
        outs = [[memoryview(bytearray(size))] for _ in keys]
        t = time.perf_counter()
        results = await tier.read_many(list(zip(keys, outs, strict=True)))
        best_r = max(best_r, blocks * size / (time.perf_counter() - t))
        assert all(x.ok for x in results) and (not exact or bytes(outs[0][0]) == bytes(data))
        await tier.delete(keys)
    return best_w, best_r, stored
