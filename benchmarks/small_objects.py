"""Small objects at file-system speed (issue #13, item 2): Posix-tier dumps and loads of many small
blocks as ratios of a plain process doing the same file work, measured side by side in one run.

For each block size (4 KiB, 64 KiB, 1 MiB) and durability setting:

- **plain dump**: one Python process creates one file per object in a sharded tree (``O_CREAT|O_EXCL``
  temp file, ``write``, ``rename`` over the final name; durable: ``fsync`` the file before the rename
  and the directory after it, as a careful writer must), new names each round (renaming over an
  existing file makes ext4 flush it, ``auto_da_alloc``: a cost neither side should pay here);
- **daemon dump**: a daemon with ``store_pipeline: Posix`` (durable or ``--no-durable``) dumping the
  same number of blocks from registered shared memory, one task, until Wait returns;
- **plain load**: ``open`` + ``pread`` + ``close`` of one file per object, page cache warm as it is
  for the daemon (these machines cannot drop caches): the daemon's own block files where it keeps one
  per object (the same files and cache state), the plain process's first-round files where the
  daemon packs them;
- **daemon load**: a Load of every block into shared memory.

The daemon runs with ``posix_pack_max_block_bytes`` (``--pack-max-block-bytes``, default 64 KiB
here; the daemon's own default is 0, off): blocks up to it are written into pack files, many to a
file (:mod:`ucm_server.store.posix.packs`). ``--also-without-packs`` adds rows with packs off.

Target: daemon dump ≥ 1.0× plain dump, daemon load ≥ 0.8× plain load, and durable 64 KiB dumps
≥ 0.5× the non-durable ones. Rounds interleave plain and daemon, repeated; medians, with the spread
(max/min of the daemon's rounds) to say how noisy the shared CPUs were.

Run: ``python -m benchmarks.small_objects [--repeat 5] [--scale 1.0] [--pack-max-block-bytes N]`` (writes
``benchmarks/results/small_objects.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_server.testing.daemon import DaemonProcess

NS = namespace_id(bench="small_objects")
RESULTS = Path(__file__).resolve().parent / "results" / "small_objects.md"
SIZES = ((4096, 4096), (65536, 1024), (1 << 20, 128))
"""(block size, blocks per round) at scale 1."""


def _plain_dump(root: Path, n: int, size: int, payload: memoryview, durable: bool, prefix: str) -> None:
    """Create+write+rename ``n`` files of ``size`` bytes named ``prefix...`` in 256 shard directories."""
    dirs: dict[int, int] = {}
    try:
        for i in range(n):
            shard = i % 256
            dfd = dirs.get(shard)
            if dfd is None:
                (root / f"{shard:02x}").mkdir(parents=True, exist_ok=True)
                dfd = dirs[shard] = os.open(root / f"{shard:02x}", os.O_RDONLY | os.O_DIRECTORY)
            name = f"{prefix}{i:08x}.blk"
            tmp = name + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
            try:
                os.write(fd, payload[i * size : (i + 1) * size])
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            if durable:
                os.fsync(dfd)
    finally:
        for dfd in dirs.values():
            os.close(dfd)


def _plain_load(files: list[Path], size: int, dest: memoryview) -> None:
    """Read the last ``size`` bytes of each file (a daemon block file's payload follows its header)."""
    for i, f in enumerate(files):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.preadv(fd, [dest[i * size : (i + 1) * size]], os.fstat(fd).st_size - size)
        finally:
            os.close(fd)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(workdir: Path, size: int, n: int, durable: bool, repeat: int, packs: int) -> dict[str, float]:
    """Blocks per second of the four paths for one size and durability; medians of ``repeat`` rounds."""
    args = ["--store-pipeline", "Posix", "--posix-pack-max-block-bytes", str(packs)]
    args += [] if durable else ["--no-durable"]
    tag = f"{size}-{'d' if durable else 'n'}-{packs}"
    with (
        DaemonProcess(workdir / f"daemon-{tag}", args=args) as d,
        UcmClient(d.target) as c,
        SharedBuffer(n * size) as src,
        SharedBuffer(n * size) as dst,
    ):
        src.array()[:] = np.random.default_rng(size).integers(0, 255, n * size, dtype=np.uint8)
        rs, rd = c.register(src), c.register(dst)
        digests = [key_digest(tag, i) for i in range(n)]
        into = [BlockIO(k, (Segment(rd, i * size, size),)) for i, k in enumerate(digests)]
        plain_root = workdir / f"plain-{tag}"
        payload = memoryview(src.buf)
        scratch = memoryview(bytearray(n * size))
        rounds = iter(range(1 << 30))

        def dump(name: str = "") -> None:
            """Dump ``n`` blocks under new keys (the first call: the keys loaded later)."""
            keys = digests if name == "first" else [key_digest(tag, name, i) for i in range(n)]
            out = [BlockIO(k, (Segment(rs, i * size, size),)) for i, k in enumerate(keys)]
            assert c.wait(c.dump(NS, out), 600).ok

        def load() -> None:
            assert c.wait(c.load(NS, into), 600).ok

        dump("first")  # warm: the shard directories exist from now on (both sides)
        _plain_dump(plain_root, n, size, payload, durable, "first")
        stored = d.data_dir / "blocks"
        packed = size <= packs
        assert bool(list(stored.rglob("*.pack"))) == packed and bool(list(stored.rglob("*.blk"))) != packed
        # The same files the daemon reads where it keeps one per object (same cache state, same
        # layout); the plain process's own where the daemon packs them.
        files = sorted(plain_root.rglob("first*.blk") if packed else stored.rglob("*.blk"))
        assert len(files) == n, len(files)
        times: dict[str, list[float]] = {"plain_dump": [], "dump": [], "plain_load": [], "load": []}
        for _ in range(repeat):
            r = f"r{next(rounds)}"
            times["plain_dump"].append(_timed(partial(_plain_dump, plain_root, n, size, payload, durable, r)))
            times["dump"].append(_timed(partial(dump, r)))
            times["plain_load"].append(_timed(lambda: _plain_load(files, size, scratch)))
            times["load"].append(_timed(load))
        assert bytes(dst.buf[: n * size]) == bytes(src.buf[: n * size])
    rates = {k: n / statistics.median(v) for k, v in times.items()}
    rates["dump_spread"] = max(times["dump"]) / min(times["dump"])
    rates["load_spread"] = max(times["load"]) / min(times["load"])
    return rates


def run(repeat: int, scale: float, packs: int, without: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ucm-small-", dir=os.environ.get("UCM_BENCH_DIR")) as tmp:
        for size, n in SIZES:
            for durable in (False, True):
                for limit in (packs, 0) if without and size <= packs else (packs,):
                    count = max(16, int(n * scale))
                    r = measure(Path(tmp), size, count, durable, repeat, limit)
                    rows.append(
                        {"size": size, "blocks": count, "durable": durable, "packs": size <= limit, **r}
                    )
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def table(rows: list[dict[str, Any]], packs: int) -> str:
    lines = [
        "| block | durable | packs | blocks | daemon dump /s | plain create+write+rename /s "
        "| dump ratio (≥ 1.0) | daemon load /s | plain open+read /s | load ratio (≥ 0.8) "
        "| noise (max/min dump, load) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["size"], r["durable"]): r for r in rows if r.get("packs", True)}
    for r in rows:
        lines.append(
            f"| {_size(r['size'])} | {'yes' if r['durable'] else 'no'} | {'yes' if r.get('packs') else 'no'} "
            f"| {r['blocks']} "
            f"| {r['dump']:,.0f} | {r['plain_dump']:,.0f} | {r['dump'] / r['plain_dump']:.2f}× "
            f"| {r['load']:,.0f} | {r['plain_load']:,.0f} | {r['load'] / r['plain_load']:.2f}× "
            f"| {r['dump_spread']:.2f}, {r['load_spread']:.2f} |"
        )
    lines.append("")
    for size, _ in SIZES:
        if (size, True) in by and (size, False) in by:
            ratio = by[(size, True)]["dump"] / by[(size, False)]["dump"]
            target = " (target ≥ 0.5)" if size == 65536 else ""
            lines.append(
                f"- durable ÷ non-durable daemon dump (packs as above), {_size(size)}: {ratio:.2f}×{target}"
            )
    lines.append("")
    lines.append(
        "Daemon: `store_pipeline: Posix`, one Dump/Load task of all blocks from/into registered shared "
        f"memory until Wait returns; packs: `posix_pack_max_block_bytes: {packs}` (blocks up to it "
        "written many to a pack file; the daemon's default is 0, one file per block). Plain: one "
        "process, one file per object in 256 shard directories (durable: fsync file, rename, fsync "
        "directory per object), loads reading the daemon's block files (its own where the daemon "
        "packs). Medians of interleaved rounds; "
        "`python -m benchmarks.small_objects`."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--scale", type=float, default=1.0, help="multiply the block counts (e.g. 0.25)")
    p.add_argument("--pack-max-block-bytes", type=int, default=64 << 10, help="the daemon's packing limit")
    p.add_argument("--also-without-packs", action="store_true", help="rows with packs off too")
    args = p.parse_args(argv)
    rows = run(args.repeat, args.scale, args.pack_max_block_bytes, args.also_without_packs)
    text = table(rows, args.pack_max_block_bytes)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
