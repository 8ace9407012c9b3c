"""Shared-tier overhead: our tier against the storage engine's own client moving the same bytes.

What it answers: how much throughput do the Mooncake and S3 tiers give up (header, checksum, staging
copy, asyncio hop, verification) compared with using Mooncake's or boto3's client directly. Reported as
ratios measured in one run (``tier / engine`` throughput; 1.0 = no overhead), never as absolute
figures to compare across machines. Engine and tier rounds alternate, and the ratio is the median of
per-round ratios, so background load on shared CPUs hits both sides alike.

- Mooncake: a "storage node" client contributes the memory; the measured clients contribute none, so
  every byte crosses the transfer engine (TCP on loopback here). Engine side: one registered buffer,
  ``batch_upsert_from`` / ``batch_get_into`` of all blocks. Tier side: ``write_many`` / ``read_many``
  of the same blocks from ordinary Python buffers.
- S3 (Ceph RGW on loopback): engine side ``put_object`` / ``get_object`` on a thread pool of the same
  width as the tier's ``max_workers``; tier side ``write_many`` / ``read_many``.

Run: ``python -m benchmarks.shared_tiers [--only mooncake|s3] [--blocks N] [--block-kib K]``. Starts and
stops its own servers (``tests/support/services.py``); prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.services import ServiceUnavailable, start_ceph_rgw, start_mooncake_master
from ucm_protocol.keys import BlockKey, Digest, Namespace
from ucm_server.store.base import Tier
from ucm_server.store.copying import IoVec

LOOKUP_KEYS = 2048


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 4)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _blocks(n: int, size: int) -> tuple[list[BlockKey], list[bytearray]]:
    ns = Namespace(os.urandom(16))
    return [BlockKey(ns, Digest(os.urandom(32))) for _ in range(n)], [
        bytearray(os.urandom(size)) for _ in range(n)
    ]


class _Interleaved:
    """Alternate engine and tier rounds so both see the same machine: on shared CPUs, measuring one
    after the other compares two different moments of background load, not two clients."""

    def __init__(self, tier: Tier, keys: list[BlockKey], datas: list[bytearray]) -> None:
        self.tier, self.keys, self.datas = tier, keys, datas
        self.outs = [bytearray(len(d)) for d in datas]
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(tier.open())

    def write(self) -> None:
        src: list[tuple[BlockKey, IoVec]] = [
            (k, [memoryview(d)]) for k, d in zip(self.keys, self.datas, strict=True)
        ]
        results = self.loop.run_until_complete(self.tier.write_many(src))
        assert all(r.ok for r in results), results[:3]

    def read(self) -> None:
        dst: list[tuple[BlockKey, IoVec]] = [
            (k, [memoryview(o)]) for k, o in zip(self.keys, self.outs, strict=True)
        ]
        results = self.loop.run_until_complete(self.tier.read_many(dst))
        assert all(r.ok for r in results), results[:3]
        assert self.outs == self.datas

    def close(self) -> None:
        self.loop.run_until_complete(self.tier.close())
        self.loop.close()


def _compare(
    nbytes: int,
    rounds: int,
    engine_put: Callable[[], object],
    engine_get: Callable[[], object],
    ours: _Interleaved,
) -> dict[str, Any]:
    """Per round: engine write, tier write, engine read, tier read; medians and per-round ratios."""
    samples: dict[str, list[float]] = {"ew": [], "tw": [], "er": [], "tr": []}
    try:
        for _ in range(rounds):
            samples["ew"].append(_timed(engine_put))
            samples["tw"].append(_timed(ours.write))
            samples["er"].append(_timed(engine_get))
            samples["tr"].append(_timed(ours.read))
    finally:
        ours.close()
    out: dict[str, Any] = {}
    for op, e, t in (("write", "ew", "tw"), ("read", "er", "tr")):
        ratios = [a / b for a, b in zip(samples[e], samples[t], strict=True)]
        out[op] = {
            "engine_GBps": _gbps(nbytes, statistics.median(samples[e])),
            "tier_GBps": _gbps(nbytes, statistics.median(samples[t])),
            "ratio": round(statistics.median(ratios), 3),
            "ratio_per_round": [round(r, 3) for r in ratios],
        }
    return out


# -- through the daemon ------------------------------------------------------------------------------------


def through_daemon(
    workdir: Path, tier: str, settings: dict[str, Any], n: int, size: int, rounds: int, lookup_keys: int
) -> dict[str, Any]:
    """Dump/Load through a real ``ucm-server`` whose only tier is the shared one (so every byte goes
    to the engine and back), and a Lookup of ``lookup_keys`` keys that a second daemon (``Cache|tier``)
    has never seen: its local index misses, the shared tier answers in one batch."""
    import yaml

    from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
    from ucm_server.testing.daemon import DaemonProcess

    workdir.mkdir(parents=True, exist_ok=True)

    def config(pipeline: str, name: str) -> Path:
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"store_pipeline": pipeline, "tier_settings": {tier: settings}}))
        return path

    ns = namespace_id(bench=uuid.uuid4().hex)
    out: dict[str, Any] = {}
    with (
        DaemonProcess(workdir / "a", args=["--config", str(config(tier, "a"))]) as a,
        UcmClient(a.target) as c,
        SharedBuffer(n * size) as buf,
    ):
        buf.buf[:] = os.urandom(n * size)
        region = c.register(buf)
        blocks = [BlockIO(key_digest("t", i), (Segment(region, i * size, size),)) for i in range(n)]
        dumps, loads = [], []
        for _ in range(rounds):
            dumps.append(_timed(lambda: c.wait(c.dump(ns, blocks, wait_durable=True), 300)))
            loads.append(_timed(lambda: c.wait(c.load(ns, blocks), 300)))
        assert c.wait(c.load(ns, blocks), 300).ok
        out["daemon_dump_GBps"] = _gbps(n * size, statistics.median(dumps))
        out["daemon_load_GBps"] = _gbps(n * size, statistics.median(loads))
        small = [
            BlockIO(key_digest("l", i), (Segment(region, (i % n) * size, 4096),)) for i in range(lookup_keys)
        ]
        for start in range(0, lookup_keys, 512):
            assert c.wait(c.dump(ns, small[start : start + 512], wait_durable=True), 300).ok
        keys = [b.key for b in small]
        with (
            DaemonProcess(workdir / "b", args=["--config", str(config(f"Cache|{tier}", "b"))]) as b,
            UcmClient(b.target) as cb,
        ):
            first = _timed(lambda: cb.lookup(ns, keys))
            samples = []
            for _ in range(20):
                samples.append(_timed(lambda: cb.lookup(ns, keys)))
            assert cb.lookup(ns, keys).hit_prefix == lookup_keys
        out["lookup_first_ms"] = round(first * 1e3, 3)
        out["lookup_p50_ms"] = round(statistics.median(samples) * 1e3, 3)
    return out


# -- Mooncake ---------------------------------------------------------------------------------------------


def bench_mooncake(workdir: Path, n: int, size: int, rounds: int) -> dict[str, Any]:
    from mooncake.store import MooncakeDistributedStore

    from ucm_server.store.mooncake import MooncakeTier

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    master = start_mooncake_master(workdir)
    storage = MooncakeDistributedStore()
    try:
        pool = max(512 << 20, 4 * n * (size + 4096))
        assert storage.setup("127.0.0.1", "P2PHANDSHAKE", pool, 16 << 20, "tcp", "", master.address) == 0
        keys, datas = _blocks(n, size)

        # The engine's own client: one registered buffer holding every block.
        direct = MooncakeDistributedStore()
        assert direct.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) == 0
        buf = bytearray(n * size)
        for i, d in enumerate(datas):
            buf[i * size : (i + 1) * size] = d
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert direct.register_buffer(addr, len(buf)) == 0
        names = [f"engine/{k.digest.hex()}" for k in keys]
        ptrs = [addr + i * size for i in range(n)]
        sizes = [size] * n

        def put() -> None:
            assert all(c == 0 for c in direct.batch_upsert_from(names, ptrs, sizes))

        def get() -> None:
            assert all(c == size for c in direct.batch_get_into(names, ptrs, sizes))

        tier = MooncakeTier(
            "Mooncake",
            master_address=master.address,
            global_segment_size=0,
            staging_bytes=max(64 << 20, 2 * (size + 128)),
            key_prefix=f"bench-{uuid.uuid4().hex[:6]}",
            timeout_s=30.0,
        )
        try:
            result = _compare(n * size, rounds, put, get, _Interleaved(tier, keys, datas))
        finally:
            direct.unregister_buffer(addr)
            direct.close()
        settings = {"master_address": master.address, "global_segment_size": 0, "timeout_s": 30.0}
        daemon = through_daemon(
            workdir / "mooncake-daemon", "Mooncake", settings, n, size, rounds, LOOKUP_KEYS
        )
        return {"start_s": round(master.started_in_s, 3), **result, "through_daemon": daemon}
    finally:
        storage.close()
        master.stop()


# -- S3 ---------------------------------------------------------------------------------------------------


def bench_s3(workdir: Path, n: int, size: int, rounds: int, workers: int) -> dict[str, Any]:
    import boto3
    from botocore.config import Config

    from ucm_server.store.s3 import S3Tier

    rgw = start_ceph_rgw(workdir)
    try:
        keys, datas = _blocks(n, size)
        client = boto3.client(
            "s3",
            endpoint_url=rgw.endpoint,
            aws_access_key_id=rgw.access_key,
            aws_secret_access_key=rgw.secret_key,
            region_name="us-east-1",
            config=Config(
                max_pool_connections=workers,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        client.create_bucket(Bucket="bench")
        names = [f"engine/{k.digest.hex()}" for k in keys]
        pool = ThreadPoolExecutor(workers)

        def put() -> None:
            list(
                pool.map(
                    lambda i: client.put_object(Bucket="bench", Key=names[i], Body=bytes(datas[i])), range(n)
                )
            )

        def get() -> None:
            got = list(
                pool.map(lambda i: client.get_object(Bucket="bench", Key=names[i])["Body"].read(), range(n))
            )
            assert got == datas

        tier = S3Tier(
            "S3",
            endpoint_url=rgw.endpoint,
            bucket="bench",
            access_key=rgw.access_key,
            secret_key=rgw.secret_key,
            prefix=f"bench-{uuid.uuid4().hex[:6]}",
            max_workers=workers,
            timeout_s=60.0,
        )
        try:
            result = _compare(n * size, rounds, put, get, _Interleaved(tier, keys, datas))
            settings = {
                "endpoint_url": rgw.endpoint,
                "bucket": "bench",
                "access_key": rgw.access_key,
                "secret_key": rgw.secret_key,
                "max_workers": workers,
                "timeout_s": 60.0,
            }
            result["through_daemon"] = through_daemon(
                workdir / "s3-daemon", "S3", settings, n, size, rounds, LOOKUP_KEYS
            )
        finally:
            pool.shutdown()
        return {"start_s": round(rgw.started_in_s, 3), "workers": workers, **result}
    finally:
        rgw.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", choices=["mooncake", "s3"], action="append")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--s3-workers", type=int, default=8)
    args = parser.parse_args(argv)
    which = args.only or ["mooncake", "s3"]
    size = args.block_kib << 10
    report: dict[str, Any] = {"blocks": args.blocks, "block_bytes": size, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="ucm-bench-") as tmp:
        for name in which:
            try:
                if name == "mooncake":
                    report[name] = bench_mooncake(Path(tmp), args.blocks, size, args.rounds)
                else:
                    report[name] = bench_s3(Path(tmp), args.blocks, size, args.rounds, args.s3_workers)
            except (ServiceUnavailable, ImportError) as exc:
                report[name] = {"skipped": str(exc)}
    print(json.dumps(report, indent=2), file=sys.stderr)
    md = table(report)
    print(md)
    out = Path(__file__).parent / "results" / "shared_tiers.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(md + "\n")
    return 0


def table(report: dict[str, Any]) -> str:
    mib = report["block_bytes"] >> 20
    lines = [
        f"| tier ({report['blocks']}×{mib} MiB) | engine's own client write / read | "
        "tier in-process (ratio) | through ucm-server (ratio) | "
        "Lookup of 2,048 keys missing locally: first (the tier answers) / repeated (cached answers) |",
        "|---|---|---|---|---|",
    ]
    for name in ("mooncake", "s3"):
        r = report.get(name)
        if not r or "skipped" in r:
            lines.append(f"| {name} | skipped: {(r or {}).get('skipped', 'not run')} | | | |")
            continue
        w, rd, d = r["write"], r["read"], r.get("through_daemon", {})
        dw = d.get("daemon_dump_GBps", 0.0)
        dr = d.get("daemon_load_GBps", 0.0)
        lines.append(
            f"| {name} | {w['engine_GBps']:.2f} / {rd['engine_GBps']:.2f} GB/s | "
            f"write {w['ratio']:.2f}×, read {rd['ratio']:.2f}× | "
            f"dump {dw:.2f} GB/s ({dw / w['engine_GBps']:.2f}×), "
            f"load {dr:.2f} GB/s ({dr / rd['engine_GBps']:.2f}×) | "
            f"{d.get('lookup_first_ms', float('nan')):.1f} ms / "
            f"{d.get('lookup_p50_ms', float('nan')):.2f} ms p50 |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
