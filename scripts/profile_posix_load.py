"""Where a Posix-tier Load of many small blocks spends its time, layer by layer (issue #13, item 2).

Measures, for one block size, the per-block cost of the same Load at four depths, all in one run on
the files one daemon wrote (page cache warm):

- ``daemon``: a Load task through gRPC into registered shared memory until Wait returns;
- ``tier``: :meth:`PosixTier.read_checked_many` in this process (the pipeline's call for a
  Posix-only daemon), no gRPC, task or pipeline;
- ``groups``: the tier's executor job (``posix.files.read_group``) called directly in one thread;
- ``plain``: ``open`` + ``preadv`` + ``close`` of each file (the baseline of
  ``benchmarks.small_objects``).

With ``--cprofile`` the daemon runs under :mod:`cProfile` (its event-loop thread; the executor's
file work shows as ``groups``) and the top functions by own time are printed.

Run: ``python scripts/profile_posix_load.py --size 4096 --blocks 4096 [--cprofile]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_protocol.keys import BlockKey, Digest, Namespace
from ucm_server.store.posix import PosixTier
from ucm_server.store.posix.files import read_group
from ucm_server.testing.daemon import DaemonProcess

NS = namespace_id(bench="profile_posix_load")


class ProfiledDaemon(DaemonProcess):
    """The daemon under ``cProfile`` (written at its clean shutdown)."""

    def __init__(self, workdir: Path, out: Path, **kw: Any) -> None:
        super().__init__(workdir, **kw)
        self.out = out

    def command(self) -> list[str]:
        cmd = super().command()
        return [cmd[0], "-m", "cProfile", "-o", str(self.out), *cmd[1:]]


def _interleaved(fns: dict[str, Callable[[], object]], n: int, repeat: int) -> dict[str, float]:
    """Median µs per block of each of ``fns``, run in turn ``repeat`` times (noise hits all alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    pick = min if os.environ.get("PROFILE_MIN") else statistics.median
    return {name: pick(ts) / n * 1e6 for name, ts in times.items()}


def _thread_cpu(pid: int) -> dict[str, float]:
    """Seconds of CPU (user + system) each thread of ``pid`` has used, by ``name/tid``; the main
    thread (the event loop) is ``main``."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        name = "main" if task.name == str(pid) else f"{(task / 'comm').read_text().strip()}/{task.name}"
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--cprofile", action="store_true")
    p.add_argument(
        "--dump-between",
        action="store_true",
        help="dump as many new blocks before each round, as benchmarks.small_objects does",
    )
    a = p.parse_args(argv)
    size, n = a.size, a.blocks
    with tempfile.TemporaryDirectory(prefix="ucm-prof-") as tmp:
        work = Path(tmp)
        prof = work / "daemon.prof"
        # One file per block: this script profiles the block-file read path (packs: small_objects).
        args = ["--store-pipeline", "Posix", "--no-durable", "--posix-pack-max-block-bytes", "0"]
        d = (
            ProfiledDaemon(work / "d", prof, args=args)
            if a.cprofile
            else DaemonProcess(work / "d", args=args)
        )
        out = memoryview(bytearray(n * size))
        dests = [[out[i * size : (i + 1) * size]] for i in range(n)]

        def plain() -> None:
            for i, f in enumerate(files):
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.preadv(fd, dests[i], os.fstat(fd).st_size - size)
                finally:
                    os.close(fd)

        with d, UcmClient(d.target) as c, SharedBuffer(n * size) as src, SharedBuffer(n * size) as dst:
            src.array()[:] = np.random.default_rng(1).integers(0, 255, n * size, dtype=np.uint8)
            rs, rd = c.register(src), c.register(dst)
            digests = [key_digest("p", i) for i in range(n)]
            blocks = [BlockIO(k, (Segment(rs, i * size, size),)) for i, k in enumerate(digests)]
            assert c.wait(c.dump(NS, blocks), 600).ok
            into = [BlockIO(k, (Segment(rd, i * size, size),)) for i, k in enumerate(digests)]
            files = sorted((d.data_dir / "blocks").rglob("*.blk"))
            assert d.proc is not None
            cpu0 = _thread_cpu(d.proc.pid)
            rounds = iter(range(1 << 30))

            def dump_new() -> None:
                r = next(rounds)
                fresh = [BlockIO(key_digest("p", r, i), b.segments) for i, b in enumerate(blocks)]
                assert c.wait(c.dump(NS, fresh), 600).ok

            fns: dict[str, Callable[[], object]] = {"dump": dump_new} if a.dump_between else {}
            fns |= {"daemon": lambda: c.wait(c.load(NS, into), 600), "plain": plain}
            first = _interleaved(fns, n, a.repeat)
            cpu1 = _thread_cpu(d.proc.pid)
            assert bytes(dst.buf[: n * size]) == bytes(src.buf[: n * size])
        keys = [BlockKey(Namespace(NS), Digest(k)) for k in digests]
        items = sorted(zip(keys, dests, strict=True), key=lambda kv: kv[0])

        async def tier_run() -> dict[str, float]:
            tier = PosixTier(roots=[d.data_dir / "blocks"], durable=False)
            await tier.open()
            await tier.indexed()
            loop = asyncio.get_running_loop()
            fns = {
                "tier": lambda: asyncio.run_coroutine_threadsafe(
                    tier.read_checked_many(items), loop
                ).result(),
                "group": lambda: read_group(tier.disk, items, True),
                "plain": plain,
            }
            got = await loop.run_in_executor(None, _interleaved, fns, n, a.repeat)
            await tier.close()
            return got

        second = asyncio.run(tier_run())
        print(f"size {size} blocks {n}: µs per block (÷ plain in the same phase)")
        for name, us, base in (
            ("daemon Load (gRPC, task, pipeline, tier)", first["daemon"], first["plain"]),
            ("tier read_checked_many (in process)", second["tier"], second["plain"]),
            ("posix.files.read_group (one thread)", second["group"], second["plain"]),
            ("plain open+preadv+close", first["plain"], first["plain"]),
        ):
            print(f"  {name:44s} {us:8.2f}  ({base / us:.2f}x plain's rate)")
        loads = n * a.repeat
        for name in sorted(cpu1):
            used = cpu1[name] - cpu0.get(name, 0.0)
            if used > 0:
                print(f"  daemon CPU, thread {name:30s} {used / loads * 1e6:8.2f} µs per block")
        if a.cprofile:
            stats = pstats.Stats(str(prof))
            stats.sort_stats("tottime").print_stats(35)
    return 0


if __name__ == "__main__":
    sys.exit(main())
