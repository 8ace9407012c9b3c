"""The daemon's core benchmark: throughput and lookup latency as ratios of baselines from the same run.

Measured (defaults: 256 blocks of 1 MiB and 4,096 of 64 KiB, 7 repeats, medians):
- memcpy of the same bytes between two warm buffers (numpy ``copyto``): the physical baseline;
- Dump and Load through the daemon, Cache tier <-> the client's registered shared memory, one task of
  all blocks, from the Dump/Load call until Wait returns: ratio to memcpy, for 1 MiB blocks (target
  >= 0.95) and 64 KiB blocks (target >= 0.8); each through the local data plane (the session's ring,
  the client's default on a Unix socket) and through gRPC (``UcmClient(dataplane=False)``, what every
  client did before), interleaved in one daemon; also how much of that time the daemon's task itself
  took (its ``elapsed_s``: the chunks' copies and bookkeeping) and the rest (the request's way in,
  its checks, the result's way back);
- two client processes loading at once against one: the aggregate throughput ratio (target >= 1.6);
- Lookup of 2,048 keys, p50, as a ratio of a bare gRPC round trip (the health ``Check``) on the same
  socket: through the raw stub, through the client library with the data plane (answered from the
  daemon's shared table; target <= 0.25) and without it (the RPC); and the client's share of the
  RPC: building the request (checking and packing the keys), timed in the same loop;
- Posix-tier Load (a daemon with ``store_pipeline: Posix``) as a ratio of reading the same block files
  straight from disk with ``preadv`` (both from the page cache, which these machines cannot drop;
  target >= 0.8).
Run: ``python -m benchmarks.daemon_bench`` (or ``make bench``). Prints a markdown table and JSON.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import mmap
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_client.arguments import lookup_request
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.store.copying import copy_all
from ucm_server.testing.daemon import DaemonProcess

NS = namespace_id(bench="daemon")


def _client(target: str, *, dataplane: bool = True) -> UcmClient:
    """A client with or without the local data plane; a tree from before it (``benchmarks.ab_daemon``
    runs this module against older packages) has no such switch, and every client there is gRPC."""
    if "dataplane" in inspect.signature(UcmClient).parameters:
        return UcmClient(target, dataplane=dataplane)
    return UcmClient(target)


def _local_lookups(c: UcmClient) -> int:
    plane = getattr(c, "_plane", None)
    return int(plane.lookups_local) if plane is not None else 0


def _task(
    task_s: dict[str, list[float]], name: str, submit: Any, c: UcmClient, blocks: list[BlockIO]
) -> None:
    """One Dump or Load of ``blocks`` through ``submit`` until it ends; its task time kept by name."""
    r = c.wait(submit(NS, blocks), 120)
    assert r.ok
    task_s.setdefault(name, []).append(r.elapsed_s)


def _median_time(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _blocks(region: int, n: int, size: int, tag: str) -> list[BlockIO]:
    return [BlockIO(key_digest(tag, i), (Segment(region, i * size, size),)) for i in range(n)]


def daemon_throughput(workdir: Path, n: int, size: int, repeat: int) -> dict[str, float]:
    """Dump and Load rounds interleaved with memcpy rounds of the same bytes, so background load on
    these shared CPUs hits the baseline and the daemon alike; medians of each. Two clients of one
    daemon take turns: one with the local data plane (the ring; keys ``dump_*``/``load_*``), one
    without (gRPC; keys ``grpc_dump_*``/``grpc_load_*``)."""
    cache = max(2 * n * size + (64 << 20), 256 << 20)
    args = ["--cache-capacity", str(cache), "--store-pipeline", "Cache"]
    with (
        DaemonProcess(workdir / f"cache-{size}", args=args) as d,
        _client(d.target) as ring,
        _client(d.target, dataplane=False) as grpc_client,
        SharedBuffer(n * size) as src,
        SharedBuffer(n * size) as dst,
    ):
        src.array()[:] = np.random.default_rng(1).integers(0, 255, n * size, dtype=np.uint8)
        dst.array()[:] = 0
        a, b = src.array(), np.empty(n * size, dtype=np.uint8)
        np.copyto(b, a)  # touch the destination first: the daemon's arena is warm too

        def memcpy() -> None:
            np.copyto(b, a)

        task_s: dict[str, list[float]] = {}
        rounds: dict[str, Any] = {"memcpy": memcpy}
        for prefix, c in (("", ring), ("grpc_", grpc_client)):
            rs, rd = c.register(src), c.register(dst)
            blocks_src, blocks_dst = _blocks(rs, n, size, "b"), _blocks(rd, n, size, "b")

            dump = functools.partial(_task, task_s, f"{prefix}dump", c.dump, c, blocks_src)
            load = functools.partial(_task, task_s, f"{prefix}load", c.load, c, blocks_dst)
            dump()
            dump()  # warm: arena pages faulted in, then reused as blocks are replaced
            load()
            rounds[f"{prefix}dump"], rounds[f"{prefix}load"] = dump, load
        times: dict[str, list[float]] = {name: [] for name in rounds}
        for v in task_s.values():
            v.clear()  # warm-up rounds are not counted
        order = ["memcpy", "dump", "grpc_dump", "memcpy", "load", "grpc_load"]
        for r in range(repeat):
            for name in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                rounds[name]()
                times[name].append(time.perf_counter() - t0)
        assert bytes(dst.buf[: 1 << 20]) == bytes(src.buf[: 1 << 20])
    out = {f"{k}_gbps": n * size / statistics.median(v) / 1e9 for k, v in times.items()}
    for kind in ("dump", "load", "grpc_dump", "grpc_load"):
        out[f"{kind}_ms"] = statistics.median(times[kind]) * 1e3
        out[f"{kind}_task_ms"] = statistics.median(task_s[kind]) * 1e3
    out["memcpy_ms"] = statistics.median(times["memcpy"]) * 1e3
    return out


def _load_rounds(
    target: str, n: int, size: int, rounds: int, dataplane: bool, start: Any, results: Any
) -> None:
    """One client process: load the ``n`` stored blocks ``rounds`` times once ``start`` opens."""
    with _client(target, dataplane=dataplane) as c, SharedBuffer(n * size) as dst:
        blocks = _blocks(c.register(dst), n, size, "b")
        assert c.wait(c.load(NS, blocks), 120).ok  # warm: the client's pages and the daemon's mapping
        start.wait()
        t0 = time.perf_counter()
        for _ in range(rounds):
            assert c.wait(c.load(NS, blocks), 120).ok
        results.put(time.perf_counter() - t0)


def _copy_rounds(n: int, size: int, rounds: int, start: Any, results: Any) -> None:
    """One process copying ``n`` blocks of ``size`` bytes ``rounds`` times once ``start`` opens, with
    the daemon's own copy routine (:func:`copy_all`: split over two threads, non-temporal stores past
    the cache) between the kinds of memory a Load copies between: from a private anonymous mapping
    (the Cache's arena) into a :class:`SharedBuffer` (a client's memory, a shared memfd mapping).
    What a process's copies get while another does the same. Buffers numpy allocates would not do:
    numpy asks for transparent huge pages, which neither the arena nor a memfd gets, and one process
    copying 1 MiB blocks between two of them got 37-39 GB/s where memfd to memfd got 29-30."""
    arena = mmap.mmap(-1, n * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with SharedBuffer(n * size) as client:
        src, dst = memoryview(arena), client.buf
        src[:] = np.random.default_rng(2).integers(0, 255, n * size, dtype=np.uint8).data
        pairs = [([dst[i * size : (i + 1) * size]], [src[i * size : (i + 1) * size]]) for i in range(n)]
        copy_all(pairs)  # both sides faulted in, as the daemon's arena and a client's warm buffer are
        start.wait()
        t0 = time.perf_counter()
        for _ in range(rounds):
            copy_all(pairs)
        results.put(time.perf_counter() - t0)
        del pairs, src, dst
    arena.close()


def _at_once(ctx: Any, target: Callable[..., None], args: tuple[Any, ...], procs_n: int) -> float:
    """Seconds until the slowest of ``procs_n`` processes running ``target(*args, start, results)``
    from one common start has finished."""
    start, results = ctx.Barrier(procs_n + 1), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, start, results)) for _ in range(procs_n)]
    for p in procs:
        p.start()
    start.wait()
    elapsed: float = max(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    return elapsed


def two_clients(
    workdir: Path, n: int, size: int, rounds: int, repeat: int = 3, dataplane: bool = True
) -> dict[str, float]:
    """Aggregate Load throughput of two client processes at once, and of one alone (alternating);
    and, as the ceiling, of one and two processes copying the same bytes with the daemon's own copy
    routine: two clients cannot add more than two such processes get on the same machine."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each: no gRPC state forked
    cache = max(2 * n * size + (64 << 20), 256 << 20)
    args = ["--cache-capacity", str(cache), "--store-pipeline", "Cache"]
    rates: dict[int, list[float]] = {1: [], 2: []}
    copied: dict[int, list[float]] = {1: [], 2: []}
    nbytes = rounds * n * size
    with DaemonProcess(workdir / f"two-{size}", args=args) as d:
        with UcmClient(d.target) as c, SharedBuffer(n * size) as src:
            assert c.wait(c.dump(NS, _blocks(c.register(src), n, size, "b")), 120).ok
        for r in range(2 * repeat):
            k = 1 + (r + 1) % 2
            load_s = _at_once(ctx, _load_rounds, (d.target, n, size, rounds, dataplane), k)
            rates[k].append(k * nbytes / load_s / 1e9)
            copied[k].append(k * nbytes / _at_once(ctx, _copy_rounds, (n, size, rounds), k) / 1e9)
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    return {
        "one_client_gbps": one,
        "two_clients_gbps": two,
        "two_vs_one": two / one,
        "copy_one_process_gbps": statistics.median(copied[1]),
        "copy_two_processes_gbps": statistics.median(copied[2]),
    }


def lookup_latency(workdir: Path, nkeys: int, samples_n: int) -> dict[str, float]:
    with (
        DaemonProcess(workdir / "lookup") as d,
        _client(d.target) as c,
        _client(d.target, dataplane=False) as rpc_client,
        SharedBuffer(nkeys * 4096) as buf,
    ):
        region = c.register(buf)
        blocks = _blocks(region, nkeys, 4096, "l")
        assert c.wait(c.dump(NS, blocks), 120).ok
        keys = [b.key for b in blocks]
        with grpc.insecure_channel(d.target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            kv = rpc.KVStoreStub(ch)
            req = pb.LookupRequest(namespace=NS, packed_keys=b"".join(keys))  # what UcmClient sends
            echo_req = health_pb2.HealthCheckRequest()

            calls = {
                "echo_p50_ms": lambda: health.Check(echo_req),
                "lookup_raw_p50_ms": lambda: kv.Lookup(req),
                "lookup_client_p50_ms": lambda: c.lookup(NS, keys),  # from the shared table
                "lookup_grpc_client_p50_ms": lambda: rpc_client.lookup(NS, keys),
                "lookup_client_build_p50_ms": lambda: lookup_request(NS, keys),  # the RPC client's share
            }
            for fn in calls.values():  # warm up
                for _ in range(20):
                    fn()
            local_before = _local_lookups(c)
            samples: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(samples_n):  # interleaved, so a burst of background load hits all of them
                for name, fn in calls.items():
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t0)
            result = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
            result["lookup_client_local_share"] = (_local_lookups(c) - local_before) / samples_n
            assert c.lookup(NS, keys).hit_prefix == nkeys
    return result


def posix_read(workdir: Path, n: int, size: int, repeat: int) -> dict[str, float]:
    args = ["--store-pipeline", "Posix", "--no-durable", "--posix-pack-max-block-bytes", "0"]  # block files
    with (
        DaemonProcess(workdir / "posix", args=args) as d,
        UcmClient(d.target) as c,
        SharedBuffer(n * size) as buf,
    ):
        region = c.register(buf)
        buf.array()[:] = np.random.default_rng(2).integers(0, 255, n * size, dtype=np.uint8)
        blocks = _blocks(region, n, size, "p")
        assert c.wait(c.dump(NS, blocks), 300).ok

        def load() -> None:
            assert c.wait(c.load(NS, blocks), 300).ok

        load()
        daemon_s = _median_time(load, repeat)
        files = sorted((d.data_dir / "blocks").rglob("*.blk"))
        assert len(files) == n
        scratch = bytearray(n * size)
        view = memoryview(scratch)

        def raw() -> None:
            for i, f in enumerate(files):
                fd = os.open(f, os.O_RDONLY)
                payload_at = os.fstat(fd).st_size - size  # after a 128-byte or 4 KiB header
                os.preadv(fd, [view[i * size : (i + 1) * size]], payload_at)
                os.close(fd)

        raw()
        raw_s = _median_time(raw, repeat)
    return {"posix_load_gbps": n * size / daemon_s / 1e9, "raw_file_read_gbps": n * size / raw_s / 1e9}


def run(
    n: int, size: int, small: int, repeat: int, nkeys: int, samples: int, with_peer: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {"blocks": n, "block_bytes": size, "small_block_bytes": small}
    small_n = n * size // small
    out["small_blocks"] = small_n
    with tempfile.TemporaryDirectory(prefix="ucm-bench-") as tmp:
        work = Path(tmp)
        out.update(daemon_throughput(work, n, size, repeat))
        out.update({f"small_{k}": v for k, v in daemon_throughput(work, small_n, small, repeat).items()})
        out.update({f"{k}_1m": v for k, v in two_clients(work, n, size, 10).items()})
        out.update({f"{k}_small": v for k, v in two_clients(work, small_n, small, 4).items()})
        out.update(lookup_latency(work, nkeys, samples))
        out.update(posix_read(work, n, size, max(3, repeat // 2)))
    for prefix in ("", "small_"):
        for kind in ("dump", "load", "grpc_dump", "grpc_load"):
            out[f"{prefix}{kind}_vs_memcpy"] = out[f"{prefix}{kind}_gbps"] / out[f"{prefix}memcpy_gbps"]
    out["lookup_vs_echo"] = out["lookup_raw_p50_ms"] / out["echo_p50_ms"]
    out["lookup_client_vs_echo"] = out["lookup_client_p50_ms"] / out["echo_p50_ms"]
    out["lookup_grpc_client_vs_echo"] = out["lookup_grpc_client_p50_ms"] / out["echo_p50_ms"]
    out["posix_vs_raw_read"] = out["posix_load_gbps"] / out["raw_file_read_gbps"]
    if with_peer:
        try:
            from benchmarks.peers.lmcache import run_lmcache_peer

            out["lmcache"] = run_lmcache_peer(chunks=n, chunk_bytes=size, lookup_keys=nkeys)
        except Exception as exc:  # the peer is optional; say why it is absent
            out["lmcache"] = None
            out["lmcache_error"] = f"{type(exc).__name__}: {exc}"
    return out


def table(r: dict[str, Any]) -> str:
    mb = r["block_bytes"] >> 20
    kb = r["small_block_bytes"] >> 10
    peer = r.get("lmcache") or {}
    memcpy = r["memcpy_gbps"]

    def peer_cell(key: str, fmt: str = "{:.2f} GB/s ({:.2f}× memcpy)") -> str:
        v = peer.get(key)
        if v is None:
            return "n/a"
        base = peer.get("memcpy_gbps") or memcpy
        return fmt.format(v, v / base)

    def rate(prefix: str, kind: str) -> str:
        return f"{r[f'{prefix}{kind}_gbps']:.2f} GB/s ({r[f'{prefix}{kind}_vs_memcpy']:.2f}× memcpy)"

    def split(prefix: str, kind: str) -> str:
        total, task = r[f"{prefix}{kind}_ms"], r[f"{prefix}{kind}_task_ms"]
        memcpy_ms = r[f"{prefix}memcpy_ms"]
        return f"{total:.1f} ms: task {task:.1f} + outside it {total - task:.1f} (memcpy {memcpy_ms:.1f} ms)"

    rows = [("memcpy (same bytes, same run)", f"{memcpy:.2f} GB/s", "", "", "baseline")]
    for prefix, label, target in (
        ("", f"{r['blocks']}×{mb} MiB", "≥ 0.95×"),
        ("small_", f"{r['small_blocks']}×{kb} KiB", "≥ 0.8×"),
    ):
        if prefix:
            rows.append(
                (f"memcpy ({label}, same run)", f"{r['small_memcpy_gbps']:.2f} GB/s", "", "", "baseline")
            )
        for kind, arrow in (("dump", f"Dump {label} → Cache"), ("load", f"Load {label} Cache →")):
            rows.append(
                (
                    arrow,
                    rate(prefix, kind),
                    rate(prefix, f"grpc_{kind}"),
                    peer_cell("store_batch_gbps" if kind == "dump" else "retrieve_batch_gbps")
                    if not prefix
                    else "",
                    target,
                )
            )
            rows.append(
                (
                    f"… where the {kind.title()}'s time goes",
                    split(prefix, kind),
                    split(prefix, f"grpc_{kind}"),
                    "",
                    "",
                )
            )
    for suffix, label in (("_1m", f"{mb} MiB"), ("_small", f"{kb} KiB")):
        rows.append(
            (
                f"Two clients loading at once, {label} blocks",
                f"{r[f'two_clients_gbps{suffix}']:.2f} GB/s ({r[f'two_vs_one{suffix}']:.2f}× one client's "
                f"{r[f'one_client_gbps{suffix}']:.2f} GB/s); the ceiling, two processes copying the "
                f"same bytes at once with the daemon's copy routine: "
                f"{r[f'copy_two_processes_gbps{suffix}']:.2f} GB/s (one alone "
                f"{r[f'copy_one_process_gbps{suffix}']:.2f}); two clients reach "
                f"{r[f'two_clients_gbps{suffix}'] / r[f'copy_two_processes_gbps{suffix}']:.2f}× of it",
                "",
                "",
                "≥ 1.6×",
            )
        )
    rows += [
        ("bare gRPC echo p50 (same socket)", f"{r['echo_p50_ms']:.3f} ms", "", "", "baseline"),
        (
            "Lookup 2,048 keys p50 (UcmClient)",
            f"{r['lookup_client_p50_ms']:.3f} ms ({r['lookup_client_vs_echo']:.2f}× echo)",
            f"{r['lookup_grpc_client_p50_ms']:.3f} ms ({r['lookup_grpc_client_vs_echo']:.2f}× echo)",
            "",
            "≤ 0.25×",
        ),
        (
            "Lookup 2,048 keys p50 (raw stub)",
            "",
            f"{r['lookup_raw_p50_ms']:.3f} ms ({r['lookup_vs_echo']:.2f}× echo)",
            f"{peer['lookup_prefix_p50_ms']:.3f} ms" if peer.get("lookup_prefix_p50_ms") else "n/a",
            "",
        ),
        (
            "… where the RPC Lookup's time goes",
            "",
            f"raw stub − echo {1e3 * (r['lookup_raw_p50_ms'] - r['echo_p50_ms']):.0f} µs (the daemon's "
            f"handler and a 64 KiB request); client − raw stub "
            f"{1e3 * (r['lookup_grpc_client_p50_ms'] - r['lookup_raw_p50_ms']):.0f} µs, of which building "
            f"the request {1e3 * r['lookup_client_build_p50_ms']:.0f} µs",
            "",
            "",
        ),
        ("raw file read of the block files", f"{r['raw_file_read_gbps']:.2f} GB/s", "", "", "baseline"),
        (
            "Load from Posix tier",
            f"{r['posix_load_gbps']:.2f} GB/s ({r['posix_vs_raw_read']:.2f}× raw read)",
            "",
            "",
            "≥ 0.8×",
        ),
    ]
    lines = [
        "| measurement | UCM, local data plane | UCM over gRPC | LMCache 0.5.6 server | target |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--small-block-bytes", type=int, default=64 << 10, help="the small blocks' size (same bytes)"
    )
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--lookup-keys", type=int, default=2048)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--no-peer", action="store_true", help="skip the LMCache side-by-side run")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "daemon.md")
    a = p.parse_args(argv)
    r = run(a.blocks, a.block_bytes, a.small_block_bytes, a.repeat, a.lookup_keys, a.samples, not a.no_peer)
    md = table(r)
    print(md)
    print(json.dumps(r, indent=2, default=str), file=sys.stderr)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
