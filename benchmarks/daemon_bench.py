"""The daemon's core benchmark: throughput and lookup latency as ratios of baselines from the same run.

Measured (defaults: 256 blocks of 1 MiB, 7 repeats, medians):
- memcpy of the same bytes between two warm buffers (numpy ``copyto``): the physical baseline;
- Dump and Load through the daemon, Cache tier <-> the client's registered shared memory, one task of
  all blocks, from the Dump/Load call until Wait returns: ratio to memcpy (target >= 0.9);
  also how much of that time the daemon's task itself took (its ``elapsed_s``: the chunks' copies and
  bookkeeping) and the rest (the request's way in, its checks, the result's way back);
- Lookup of 2,048 keys, p50, as a ratio of a bare gRPC round trip (the health ``Check``) on the same
  socket, through the raw stub (target <= 2) and through the client library (target <= 1.3); and
  the client's share: building the request (checking and packing the keys), timed in the same loop;
- Posix-tier Load (a daemon with ``store_pipeline: Posix``) as a ratio of reading the same block files
  straight from disk with ``preadv`` (both from the page cache, which these machines cannot drop;
  target >= 0.8).
Run: ``python -m benchmarks.daemon_bench`` (or ``make bench``). Prints a markdown table and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_client.arguments import lookup_request
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

NS = namespace_id(bench="daemon")


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
    these shared CPUs hits the baseline and the daemon alike; medians of each."""
    cache = max(2 * n * size + (64 << 20), 256 << 20)
    args = ["--cache-capacity", str(cache), "--store-pipeline", "Cache"]
    with (
        DaemonProcess(workdir / "cache", args=args) as d,
        UcmClient(d.target) as c,
        SharedBuffer(n * size) as src,
        SharedBuffer(n * size) as dst,
    ):
        src.array()[:] = np.random.default_rng(1).integers(0, 255, n * size, dtype=np.uint8)
        dst.array()[:] = 0
        rs, rd = c.register(src), c.register(dst)
        blocks_src, blocks_dst = _blocks(rs, n, size, "b"), _blocks(rd, n, size, "b")
        a, b = src.array(), np.empty(n * size, dtype=np.uint8)
        np.copyto(b, a)  # touch the destination first: the daemon's arena is warm too

        def memcpy() -> None:
            np.copyto(b, a)

        task_s: dict[str, list[float]] = {"dump": [], "load": []}

        def dump() -> None:
            r = c.wait(c.dump(NS, blocks_src), 120)
            assert r.ok
            task_s["dump"].append(r.elapsed_s)

        def load() -> None:
            r = c.wait(c.load(NS, blocks_dst), 120)
            assert r.ok
            task_s["load"].append(r.elapsed_s)

        dump()
        dump()  # warm: arena pages faulted in, then reused as blocks are replaced
        load()
        times: dict[str, list[float]] = {"memcpy": [], "dump": [], "load": []}
        for v in task_s.values():
            v.clear()  # warm-up rounds are not counted
        for _ in range(repeat):
            for name, fn in (
                ("memcpy", memcpy),
                ("dump", dump),
                ("memcpy", memcpy),
                ("load", load),
            ):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        assert bytes(dst.buf[: 1 << 20]) == bytes(src.buf[: 1 << 20])
    out = {f"{k}_gbps": n * size / statistics.median(v) / 1e9 for k, v in times.items()}
    for kind in ("dump", "load"):
        out[f"{kind}_ms"] = statistics.median(times[kind]) * 1e3
        out[f"{kind}_task_ms"] = statistics.median(task_s[kind]) * 1e3
    out["memcpy_ms"] = statistics.median(times["memcpy"]) * 1e3
    return out


def lookup_latency(workdir: Path, nkeys: int, samples_n: int) -> dict[str, float]:
    with DaemonProcess(workdir / "lookup") as d, UcmClient(d.target) as c, SharedBuffer(nkeys * 4096) as buf:
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
                "lookup_client_p50_ms": lambda: c.lookup(NS, keys),
                "lookup_client_build_p50_ms": lambda: lookup_request(NS, keys),  # its share
            }
            for fn in calls.values():  # warm up
                for _ in range(20):
                    fn()
            samples: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(samples_n):  # interleaved, so a burst of background load hits all three
                for name, fn in calls.items():
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t0)
            result = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
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


def run(n: int, size: int, repeat: int, nkeys: int, samples: int, with_peer: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"blocks": n, "block_bytes": size}
    with tempfile.TemporaryDirectory(prefix="ucm-bench-") as tmp:
        work = Path(tmp)
        out.update(daemon_throughput(work, n, size, repeat))
        out.update(lookup_latency(work, nkeys, samples))
        out.update(posix_read(work, n, size, max(3, repeat // 2)))
    out["dump_vs_memcpy"] = out["dump_gbps"] / out["memcpy_gbps"]
    out["load_vs_memcpy"] = out["load_gbps"] / out["memcpy_gbps"]
    out["lookup_vs_echo"] = out["lookup_raw_p50_ms"] / out["echo_p50_ms"]
    out["lookup_client_vs_echo"] = out["lookup_client_p50_ms"] / out["echo_p50_ms"]
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
    peer = r.get("lmcache") or {}
    memcpy = r["memcpy_gbps"]

    def peer_cell(key: str, fmt: str = "{:.2f} GB/s ({:.2f}× memcpy)") -> str:
        v = peer.get(key)
        if v is None:
            return "n/a"
        base = peer.get("memcpy_gbps") or memcpy
        return fmt.format(v, v / base)

    def split(kind: str) -> str:
        total, task = r[f"{kind}_ms"], r[f"{kind}_task_ms"]
        outside = total - task
        return f"{total:.1f} ms: task {task:.1f} + outside it {outside:.1f} (memcpy {r['memcpy_ms']:.1f} ms)"

    rows = [
        ("memcpy (same bytes, same run)", f"{memcpy:.2f} GB/s", "", "baseline"),
        (
            f"Dump {r['blocks']}×{mb} MiB → Cache",
            f"{r['dump_gbps']:.2f} GB/s ({r['dump_vs_memcpy']:.2f}× memcpy)",
            peer_cell("store_batch_gbps"),
            "≥ 0.9×",
        ),
        ("… where the Dump's time goes", split("dump"), "", ""),
        (
            f"Load {r['blocks']}×{mb} MiB Cache →",
            f"{r['load_gbps']:.2f} GB/s ({r['load_vs_memcpy']:.2f}× memcpy)",
            peer_cell("retrieve_batch_gbps"),
            "≥ 0.9×",
        ),
        ("… where the Load's time goes", split("load"), "", ""),
        ("bare gRPC echo p50 (same socket)", f"{r['echo_p50_ms']:.3f} ms", "", "baseline"),
        (
            "Lookup 2,048 keys p50 (raw stub)",
            f"{r['lookup_raw_p50_ms']:.3f} ms ({r['lookup_vs_echo']:.2f}× echo)",
            f"{peer['lookup_prefix_p50_ms']:.3f} ms" if peer.get("lookup_prefix_p50_ms") else "n/a",
            "≤ 2×",
        ),
        (
            "Lookup 2,048 keys p50 (UcmClient)",
            f"{r['lookup_client_p50_ms']:.3f} ms ({r['lookup_client_vs_echo']:.2f}× echo)",
            "",
            "≤ 1.3×",
        ),
        (
            "… where the Lookup's time goes",
            f"raw stub − echo {1e3 * (r['lookup_raw_p50_ms'] - r['echo_p50_ms']):.0f} µs (the daemon's "
            f"handler and a 64 KiB request); UcmClient − raw stub "
            f"{1e3 * (r['lookup_client_p50_ms'] - r['lookup_raw_p50_ms']):.0f} µs, of which building "
            f"the request {1e3 * r['lookup_client_build_p50_ms']:.0f} µs",
            "",
            "",
        ),
        ("raw file read of the block files", f"{r['raw_file_read_gbps']:.2f} GB/s", "", "baseline"),
        (
            "Load from Posix tier",
            f"{r['posix_load_gbps']:.2f} GB/s ({r['posix_vs_raw_read']:.2f}× raw read)",
            "",
            "≥ 0.8×",
        ),
    ]
    lines = ["| measurement | UCM | LMCache 0.5.6 server | target |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-bytes", type=int, default=1 << 20)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--lookup-keys", type=int, default=2048)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--no-peer", action="store_true", help="skip the LMCache side-by-side run")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "daemon.md")
    a = p.parse_args(argv)
    r = run(a.blocks, a.block_bytes, a.repeat, a.lookup_keys, a.samples, not a.no_peer)
    md = table(r)
    print(md)
    print(json.dumps(r, indent=2, default=str), file=sys.stderr)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
