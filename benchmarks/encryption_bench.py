"""The cost of encryption at rest: dump and load throughput of the Posix tier
with and without the per-tenant AES-256-GCM wrapper, and the cipher alone on one core.

``python -m benchmarks.encryption_bench`` prints a markdown table and writes
``benchmarks/results/encryption.md``. The tier is the daemon's own (:class:`PosixTier`, files in a
temporary directory, ``durable=False`` so the disk's fsync does not hide the cipher's cost; the page
cache then serves reads, which is the worst case for the cipher's share). Each figure is the best of
``--repeats`` runs of ``--blocks`` blocks of ``--block-size``, measured back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from benchmarks.results_file import publish
from benchmarks.tier_rates import parser, tier_rates
from ucm_protocol.keys import BlockKey
from ucm_server.store.base import Tier
from ucm_server.store.encrypted import EncryptedTier, TenantKey, open_envelope, seal
from ucm_server.store.posix import PosixTier

NS = b"encryption-bench"


class _OneKey:
    def __init__(self, key: TenantKey) -> None:
        self.key = key

    def key_for(self, namespace: bytes) -> TenantKey | None:
        return self.key


async def _measure(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    rows = []
    key = TenantKey.from_bytes(os.urandom(32))
    for name in ("Posix", "Posix + AES-256-GCM"):
        with tempfile.TemporaryDirectory(prefix="ucm-enc-") as tmp:
            posix = PosixTier(roots=[Path(tmp)], durable=False, direct_io=False)
            tier: Tier = posix if name == "Posix" else EncryptedTier(posix, _OneKey(key))
            await tier.open()
            try:
                w, r, _ = await tier_rates(
                    tier, NS, memoryview(os.urandom(args.block_size)), args.blocks, args.repeats
                )
            finally:
                await tier.close()
            rows.append((name, w, r))
    block = BlockKey(NS, bytes(32))
    data = [memoryview(os.urandom(args.block_size))]
    out = [memoryview(bytearray(args.block_size))]
    best_s = best_o = 0.0
    for _ in range(args.repeats):
        t = time.perf_counter()
        sealed = seal(key, block, data)
        best_s = max(best_s, args.block_size / (time.perf_counter() - t))
        t = time.perf_counter()
        assert open_envelope(key, block, memoryview(sealed), out).ok
        best_o = max(best_o, args.block_size / (time.perf_counter() - t))
    rows.append(("cipher alone, one core (seal / open)", best_s, best_o))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__, 64).parse_args(argv)
    rows = asyncio.run(_measure(args))
    lines = [
        "# Encryption at rest: the cost on dump and load",
        "",
        f"`python -m benchmarks.encryption_bench`: {args.blocks} blocks of {args.block_size >> 20} MiB, "
        f"Posix tier without fsync (page cache), best of {args.repeats}, 2 shared CPUs.",
        "",
        "| path | dump GB/s | load GB/s |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {w / 1e9:.2f} | {r / 1e9:.2f} |" for name, w, r in rows]
    text = "\n".join(lines) + "\n"
    publish("encryption", text, write=not args.no_write)


if __name__ == "__main__":
    main()
