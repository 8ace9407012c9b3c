"""The store at scale: restart and index figures beside plain-process baselines.

``python -m benchmarks.scale_bench`` (also in ``make bench``) prints a markdown table and writes
``benchmarks/results/scale.md``. Each row comes from one measurement function in
:data:`MEASUREMENTS` (add a function to add rows: they do not depend on each other). Timings are
medians of ``--repeats`` runs measured back to back with their baseline in the same run, on the same
file system; the table gives the spread so the noise of a shared machine shows.

Rows:

* restart to first answer: a daemon (``Posix`` only) over N stored 4 KiB blocks, from process start
  to its first answered Lookup; after a clean stop and after ``kill -9``. Baseline: the same daemon
  over an empty store.
* restart to full index: until every block is indexed (clean: from the snapshot; ``kill -9``: by
  re-adoption, periodic snapshots off; ``kill -9, periodic snapshot``: periodic snapshots every
  second, one written after one more block was stored, then SIGKILL): the Lookup RPC answers for
  every block. The presence table local clients read is filled in the background after that (it
  answers nothing meanwhile: they ask the RPC); the clean row also says when it first answered a
  lookup of a stored block. Baseline: a plain process opening every block file and reading its header.
* periodic snapshot while serving: its duration and how long collecting the keys held the event loop.
* memory per indexed block: the daemon's RSS with N blocks minus an empty daemon's, per block; and
  the index structure alone under ``tracemalloc`` for 100k and 1M synthetic keys.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ucm_client import UcmClient, key_digest, namespace_id
from ucm_protocol.keys import BlockKey
from ucm_server.store.format import FLAT_LAYOUT_VERSION, HEADER_SIZE, encode_header, payload_checksum
from ucm_server.store.posix import PosixTier
from ucm_server.store.posix.block_index import BlockIndex
from ucm_server.store.posix.packs import Pack, head_len, new_pack_id
from ucm_server.testing.daemon import DaemonProcess

RESULTS = Path(__file__).resolve().parent / "results" / "scale.md"
POSIX_ONLY = ["--store-pipeline", "Posix", "--posix-pack-max-block-bytes", "0"]
"""One file per block (packs off): the restart baselines read every block file's header."""
PERIODIC_OFF = ["--posix-snapshot-interval-s", "0"]
PERIODIC_1S = ["--posix-snapshot-interval-s", "1"]
NS = namespace_id(model="scale-bench", dtype="uint8")
BLOCK = 4096


@dataclass
class Options:
    blocks: list[int]
    repeats: int
    workdir: Path
    stores: dict[int, DaemonProcess] = field(default_factory=dict)
    """A daemon work directory per block count, planted once and shared by the measurements."""


@dataclass(frozen=True)
class Row:
    what: str
    blocks: int
    ucm: str
    baseline: str
    ratio: str
    target: str


Measurement = Callable[[Options], list[Row]]


# -- stores -------------------------------------------------------------------------------------------
def _plant(root: Path, n: int) -> None:
    """``n`` 4 KiB block files written as the daemon writes buffered ones (no daemon, no fsync)."""
    tier = PosixTier(roots=[root])
    data = os.urandom(BLOCK)
    checksum = payload_checksum([memoryview(data)])
    made: set[Path] = set()
    for i in range(n):
        key = BlockKey(NS, key_digest("scale", i))
        path = tier.path_of(key)
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            made.add(path.parent)
        path.write_bytes(encode_header(key, BLOCK, checksum, version=FLAT_LAYOUT_VERSION) + data)


def store(opts: Options, n: int) -> DaemonProcess:
    """A daemon over ``n`` planted blocks (Posix only), cleanly stopped once (snapshot written);
    periodic snapshots off, so a ``kill -9`` restart re-adopts (:func:`periodic_rows` turns them on)."""
    if n not in opts.stores:
        d = DaemonProcess(opts.workdir / f"store-{n}", args=[*POSIX_ONLY, *PERIODIC_OFF])
        if n:
            _plant(d.data_dir / "blocks", n)
        with d, UcmClient(d.target) as c:
            _wait_indexed(c, n)
        opts.stores[n] = d
    return opts.stores[n]


def _posix(c: UcmClient) -> tuple[int, dict[str, float]]:
    tier = next(t for t in c.stats().tiers if t.kind == "Posix")
    return int(tier.blocks), dict(tier.extra)


def _wait_indexed(c: UcmClient, n: int, timeout_s: float = 600) -> tuple[float, float]:
    """Seconds (monotonic clock) at which every block was in the index, and at which background
    indexing (snapshot sweep included) ended."""
    complete, swept, _ = _wait_indexed_and_table(c, n, timeout_s, probe=None)
    return complete, swept


def _wait_indexed_and_table(
    c: UcmClient, n: int, timeout_s: float = 600, *, probe: bytes | None
) -> tuple[float, float, float]:
    """:func:`_wait_indexed`, and (``probe``: a stored block's digest) the first moment after the
    index was complete at which the client's shared presence table answered a lookup of it."""
    deadline = time.monotonic() + timeout_s
    complete = table = 0.0
    while time.monotonic() < deadline:
        blocks, extra = _posix(c)
        now = time.monotonic()
        if not complete and blocks >= n and not extra.get("index_adopting"):
            complete = now
        if complete and probe is not None and not table:
            local = c._plane.lookups_local
            assert c.lookup(NS, [probe]).hit_prefix == 1
            if c._plane.lookups_local > local:
                table = time.monotonic()
        if complete and "index_adopting" not in extra and (table or probe is None):
            return complete, now, table
        time.sleep(0.005)
    raise TimeoutError(f"index of {n} blocks not complete in {timeout_s}s")


def _restart(d: DaemonProcess, n: int, *, crash: bool) -> tuple[float, float, float, float, float]:
    """(first answer, full index, sweep done) seconds after the process started, restarting after a
    clean stop or after ``kill -9``, the indexing time the daemon logged (from its start), and when
    the shared presence table first answered (seconds after the process started)."""
    if crash:
        d.start()
        d.kill()  # the marker is gone: the next start re-adopts
    started = time.monotonic()
    d.start()
    with UcmClient(d.target) as c:
        c.lookup(NS, [key_digest("scale", 0)])
        first = time.monotonic() - started
        complete, swept, table = _wait_indexed_and_table(
            c, n, probe=key_digest("scale", max(n - 1, 0)) if n else None
        )
    d.stop()
    log = d.log()
    pattern = r"indexed from snapshots in ([0-9.]+)s" if not crash else r"indexed from /.* in ([0-9.]+)s"
    logged = re.findall(pattern, log)
    load = float(logged[-1]) if logged else swept - started
    return first, complete - started, swept - started, load, table - started


def plain_header_read(root: Path) -> float:
    """Seconds a plain process takes to open every block file under ``root`` and read its header."""
    code = (
        "import os,sys,time\n"
        "t=time.perf_counter()\n"
        "for dp,dn,fn in os.walk(sys.argv[1]):\n"
        "    for f in fn:\n"
        "        if f.endswith('.blk'):\n"
        "            fd=os.open(os.path.join(dp,f),os.O_RDONLY)\n"
        "            os.pread(fd,128,0); os.close(fd)\n"
        "print(time.perf_counter()-t)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, check=True)
    return float(out.stdout)


def _med(values: list[float]) -> tuple[float, str]:
    m = statistics.median(values)
    return m, f"±{(max(values) - min(values)) / 2 / m:.0%}" if m and len(values) > 1 else ""


# -- measurements -------------------------------------------------------------------------------------
def restart_rows(opts: Options) -> list[Row]:
    rows: list[Row] = []
    empty = store(opts, 0)
    for n in opts.blocks:
        d = store(opts, n)
        runs: dict[str, list[tuple[float, float, float, float, float]]] = {"clean": [], "kill -9": []}
        base_first: list[float] = []
        base_read: list[float] = []
        for _ in range(opts.repeats):  # back to back: baseline, clean, crash
            base_first.append(_restart(empty, 0, crash=False)[0])
            base_read.append(plain_header_read(d.data_dir / "blocks"))
            runs["clean"].append(_restart(d, n, crash=False))
            runs["kill -9"].append(_restart(d, n, crash=True))
        bf, bf_noise = _med(base_first)
        br, br_noise = _med(base_read)
        for how, results in runs.items():
            first, first_noise = _med([r[0] for r in results])
            full, full_noise = _med([r[1] for r in results])
            rows.append(
                Row(
                    f"restart to first answer ({how})",
                    n,
                    f"{first:.2f} s {first_noise}",
                    f"empty store {bf:.2f} s {bf_noise}",
                    f"{first / bf:.2f}×",
                    "≤ 1 s",
                )
            )
            if how == "clean":
                load, load_noise = _med([r[3] for r in results])
                table, table_noise = _med([r[4] for r in results])
                rows.append(
                    Row(
                        "restart to full index (clean, snapshot)",
                        n,
                        f"{full:.2f} s {full_noise} from start; snapshot load {load:.3f} s {load_noise} "
                        f"= {n / max(load, 1e-3) / 1e6:.2f} M blocks/s; shared table answering "
                        f"{table:.2f} s {table_noise} from start",
                        f"header read {br:.2f} s {br_noise}",
                        f"{br / max(load, 1e-3):.1f}× the header-read rate",
                        "≥ 2 M blocks/s",
                    )
                )
                sweep, sweep_noise = _med([r[2] for r in results])
                rows.append(
                    Row(
                        "… and its background check of every header",
                        n,
                        f"{sweep:.2f} s {sweep_noise}",
                        f"header read {br:.2f} s {br_noise}",
                        f"{br / sweep:.2f}× the header-read rate",
                        "(serving throughout)",
                    )
                )
            else:
                adopt, adopt_noise = _med([r[3] for r in results])
                rows.append(
                    Row(
                        "restart to full index (kill -9, re-adoption)",
                        n,
                        f"{full:.2f} s {full_noise} from start; re-adoption {adopt:.2f} s {adopt_noise}",
                        f"header read {br:.2f} s {br_noise}",
                        f"{br / adopt:.2f}× the header-read rate",
                        "≥ 0.5× header-read rate",
                    )
                )
    return rows


def _crash_after_periodic(d: DaemonProcess, n: int) -> tuple[float, float, float, float, float, float]:
    """Start over ``n`` blocks with periodic snapshots every second, store one more block, wait for
    the periodic snapshot that holds it, ``kill -9``, restart: (first answer, full index, sweep done,
    snapshot load as logged, periodic write seconds, loop stall seconds); the extra block is then
    deleted and the daemon stopped cleanly, leaving the store as it was."""
    extra = key_digest("scale-extra", n)
    d.start()
    with UcmClient(d.target) as c:
        _wait_indexed(c, n)
        assert c.put_blocks(NS, [(extra, os.urandom(BLOCK))]).ok
        deadline = time.monotonic() + 600
        while _posix(c)[1].get("index_snapshot_blocks", 0) < n + 1:
            assert time.monotonic() < deadline, "no periodic snapshot written"
            time.sleep(0.05)
        figures = _posix(c)[1]
    d.kill()
    started = time.monotonic()
    d.start()
    with UcmClient(d.target) as c:
        c.lookup(NS, [key_digest("scale", 0)])
        first = time.monotonic() - started
        complete, swept = _wait_indexed(c, n + 1)
        assert c.delete(NS, [extra]) == 1
    d.stop()
    logged = re.findall(r"indexed from snapshots in ([0-9.]+)s", d.log())
    load = float(logged[-1]) if logged else swept - started
    return (
        first,
        complete - started,
        swept - started,
        load,
        figures["index_snapshot_duration_s"],
        figures["index_snapshot_stall_s"],
    )


def periodic_rows(opts: Options) -> list[Row]:
    """Restart after ``kill -9`` from a periodic snapshot, beside the header-read baseline."""
    rows: list[Row] = []
    for n in opts.blocks:
        d = store(opts, n)
        d.extra_args = [*POSIX_ONLY, *PERIODIC_1S]
        runs: list[tuple[float, float, float, float, float, float]] = []
        base_read: list[float] = []
        try:
            for _ in range(opts.repeats):
                base_read.append(plain_header_read(d.data_dir / "blocks"))
                runs.append(_crash_after_periodic(d, n))
        finally:
            d.extra_args = [*POSIX_ONLY, *PERIODIC_OFF]
        br, br_noise = _med(base_read)
        full, full_noise = _med([r[1] for r in runs])
        load, load_noise = _med([r[3] for r in runs])
        sweep, sweep_noise = _med([r[2] for r in runs])
        write, write_noise = _med([r[4] for r in runs])
        stall, stall_noise = _med([r[5] for r in runs])
        first, first_noise = _med([r[0] for r in runs])
        header = f"header read {br:.2f} s {br_noise}"
        rows += [
            Row(
                "restart to first answer (kill -9, periodic snapshot)",
                n,
                f"{first:.2f} s {first_noise}",
                "",
                "",
                "≤ 1 s",
            ),
            Row(
                "restart to full index (kill -9, periodic snapshot)",
                n,
                f"{full:.2f} s {full_noise} from start; snapshot load {load:.3f} s {load_noise} "
                f"= {n / max(load, 1e-3) / 1e6:.2f} M blocks/s",
                header,
                f"{br / max(load, 1e-3):.1f}× the header-read rate",
                "≥ 2 M blocks/s",
            ),
            Row(
                "… and its background check of every header",
                n,
                f"{sweep:.2f} s {sweep_noise}",
                header,
                f"{br / sweep:.2f}× the header-read rate",
                "(serving throughout)",
            ),
            Row(
                "periodic snapshot while serving: write / event-loop stall",
                n,
                f"{write:.3f} s {write_noise} / {stall * 1e3:.1f} ms {stall_noise}",
                "",
                "",
                "(off the loop but the key copy)",
            ),
        ]
    return rows


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def daemon_memory_rows(opts: Options) -> list[Row]:
    rows: list[Row] = []
    for n in opts.blocks:
        per_block: list[float] = []
        for _ in range(opts.repeats):
            sizes = []
            for d, count in ((store(opts, 0), 0), (store(opts, n), n)):
                d.start()
                with UcmClient(d.target) as c:
                    _wait_indexed(c, count)
                    assert d.proc is not None
                    sizes.append(_rss(d.proc.pid))
                d.stop()
            per_block.append((sizes[1] - sizes[0]) / n)
        value, noise = _med(per_block)
        rows.append(
            Row("daemon RSS per indexed block", n, f"{value:.0f} B {noise}", "empty daemon", "", "≤ 256 B")
        )
    return rows


def index_memory_rows(opts: Options) -> list[Row]:
    rows: list[Row] = []
    for n in (100_000, 1_000_000):
        keys = [BlockKey(NS, os.urandom(32)) for _ in range(n)]
        stored = time.time()
        tracemalloc.start()
        index = BlockIndex()
        for key in keys:
            index.add(key, BLOCK, stored)
        keys_bytes = n * (sys.getsizeof(keys[0]) + 7) // 8 * 8  # the keys are held by the index
        used = tracemalloc.get_traced_memory()[0] + keys_bytes
        tracemalloc.stop()
        rows.append(
            Row(
                "index memory per block (tracemalloc, keys included)",
                n,
                f"{used / n:.0f} B",
                "",
                "",
                "≤ 256 B",
            )
        )
        del index, keys
    return rows


def _synthetic_store(root: Path, n: int, *, packed: bool) -> PosixTier:
    """A tier over ``root`` whose index holds ``n`` synthetic 4 KiB blocks stored over ``n / 1000``
    seconds (no files): in block files, or ``packed`` 64 to a pack as the daemon packs a dump."""
    tier = PosixTier(roots=[root])
    now = time.time()
    pack: Pack | None = None
    for i in range(n):
        key = BlockKey(NS, os.urandom(32))
        if not packed:
            tier._index.add(key, BLOCK, now + i / 1000)
            continue
        if i % 64 == 0:
            pack = tier._packs.register(Pack(new_pack_id(), root))
        assert pack is not None
        pack.add(key, head_len(64) + (i % 64) * (HEADER_SIZE + BLOCK))
        tier._index.put(key, pack.stamp(BLOCK, now + i / 1000))
    return tier


def snapshot_rows(opts: Options) -> list[Row]:
    """Writing and loading the index snapshot of 1M synthetic blocks in this process (no files), in
    block files and in packs; the load as the tier does it at start-up (read, check, build, install)."""
    rows: list[Row] = []
    for packed in (False, True):
        with tempfile.TemporaryDirectory(prefix="ucm-snap-") as tmp:
            root = Path(tmp)
            writer = _synthetic_store(root, 1_000_000, packed=packed)
            writes, loads = [], []
            for _ in range(opts.repeats):
                started = time.perf_counter()
                writer.recovery.write_snapshots(*writer._index.columns())
                writes.append(time.perf_counter() - started)
                epoch = (root / "index.clean").read_bytes()
                reader = PosixTier(roots=[root])
                started = time.perf_counter()
                loaded, total, _, found = reader.recovery.load_snapshots([epoch])
                reader._index.install(loaded, total)
                reader.recovery._register_loaded(found, [], len(loaded) == 1_000_000)
                loads.append(time.perf_counter() - started)
                assert len(reader._index) == 1_000_000 and len(reader._packs.packs) == (
                    15_625 if packed else 0
                )
                del reader, loaded, found
            write, write_noise = _med(writes)
            load, load_noise = _med(loads)
            del writer
        layout = "packs of 64" if packed else "block files"
        rows += [
            Row(
                f"index snapshot write (at shutdown; {layout})",
                1_000_000,
                f"{write:.2f} s {write_noise}",
                "",
                "",
                "",
            ),
            Row(
                f"index snapshot load ({layout})",
                1_000_000,
                f"{load:.2f} s {load_noise} = {1 / load:.2f} M blocks/s",
                "",
                "",
                "≥ 2 M blocks/s",
            ),
        ]
    return rows


MEASUREMENTS: list[Measurement] = [
    restart_rows,
    periodic_rows,
    daemon_memory_rows,
    index_memory_rows,
    snapshot_rows,
]
"""One function per group of rows; add one to add rows."""


def table(rows: list[Row]) -> str:
    lines = [
        "| what | blocks | UCM | plain baseline, same run | ratio | target |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r.what} | {r.blocks:,} | {r.ucm} | {r.baseline} | {r.ratio} | {r.target} |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", default="10000,100000", help="comma-separated block counts (4 KiB blocks)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", action="append", help="run only these measurement functions (by name)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    only = "".join(f" --only {name}" for name in args.only or ())
    command = f"python -m benchmarks.scale_bench --blocks {args.blocks} --repeats {args.repeats}{only}"
    with tempfile.TemporaryDirectory(prefix="ucm-scale-") as tmp:
        opts = Options([int(x) for x in args.blocks.split(",")], args.repeats, Path(tmp))
        rows: list[Row] = []
        for measure in MEASUREMENTS:
            if args.only and measure.__name__ not in args.only:
                continue
            started = time.monotonic()
            rows += measure(opts)
            print(f"{measure.__name__}: {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
        text = (
            "# The store at scale\n\n"
            f"`{command}`, "
            f"4 KiB blocks, Posix tier only, on {os.cpu_count()} CPUs shared with other work; medians, "
            "± half the spread of the repeats.\n\n" + table(rows) + "\n"
        )
        print(text, flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
