"""GPU check of the CUDA IPC data path: correctness across processes, and throughput against memcpy.

Run through ``benchmarks/gpu_check.sh`` (it installs what the GPU image lacks). This file is both the
orchestrator (starts daemons, runs the client, enforces timeouts, prints the report) and, with
``--client``, the separate client process that owns the CUDA tensors:

* ``cache`` phase: ucm-server with ``store_pipeline: Cache`` (arena pinned, 2 MiB pages, ``gpu: on``).
  The client registers two torch CUDA tensors by IPC, dumps N 2 MiB blocks from one, loads them into the
  other and compares bytes; then times ``rounds`` dumps and loads (submit to ``wait`` returning, as a
  caller sees it) and, in the same process, plain ``cudaMemcpyAsync`` of the same blocks between device
  memory and pinned host memory (one stream, one sync per pass). Ratios are daemon / plain.
* ``tiered`` phase: ``Cache|Posix`` with a Cache smaller than the data, so dumps overflow into the bounce
  buffer and write-back, and loads come from Posix through the bounce buffer; bytes compared.

The report is JSON plus a markdown table on stdout, and ``gpu_check.json`` / ``gpu_check.md`` in
``--out``. Exit status 0 only if every correctness check passed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK = 2 << 20
MiB = 1 << 20
PAGES = ["--cache-page-size", "2MiB"]


# -- the client process -----------------------------------------------------------------------------------
def _client(target: str, phase: str, blocks: int, rounds: int) -> dict[str, Any]:
    import cupy
    import torch
    from cupy.cuda import runtime as rt

    from ucm_client import BlockIO, Segment, UcmClient, key_digest, namespace_id
    from ucm_client.cuda_ipc import producers_done

    out: dict[str, Any] = {
        "phase": phase,
        "blocks": blocks,
        "block_bytes": BLOCK,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cupy": cupy.__version__,
        "device": torch.cuda.get_device_name(0),
        "driver": rt.driverGetVersion(),
    }
    ns = namespace_id(model="gpu-check", phase=phase)
    nbytes = blocks * BLOCK
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with UcmClient(target, client_name=f"gpu-check-{phase}", rpc_timeout_s=60) as client:
        began = time.perf_counter()
        rs = client.register_cuda(src, label="src")
        rd = client.register_cuda(dst, label="dst")
        out["register_s"] = round(time.perf_counter() - began, 4)
        keys = [key_digest("gpu-check", phase, i) for i in range(blocks)]
        from_src = [BlockIO(k, (Segment(rs, i * BLOCK, BLOCK),)) for i, k in enumerate(keys)]
        into_dst = [BlockIO(k, (Segment(rd, i * BLOCK, BLOCK),)) for i, k in enumerate(keys)]

        producers_done()
        dump = client.wait(client.dump(ns, from_src, wait_durable=phase == "tiered"), 120)
        out["dump_ok"] = dump.ok
        out["dump_reasons"] = dict(list(dump.reasons.items())[:3])
        load = client.wait(client.load(ns, into_dst), 120)
        out["load_ok"] = load.ok
        out["load_reasons"] = dict(list(load.reasons.items())[:3])
        torch.cuda.synchronize()
        out["identical"] = bool(torch.equal(src, dst))
        out["mismatched_bytes"] = int((src != dst).sum().item())
        if phase != "cache" or not (dump.ok and load.ok):
            return out

        dumps: list[float] = []
        loads: list[float] = []
        for _ in range(rounds):
            producers_done()
            began = time.perf_counter()
            r = client.wait(client.dump(ns, from_src), 120)
            dumps.append(time.perf_counter() - began)
            out["dump_ok"] &= r.ok
            began = time.perf_counter()
            r = client.wait(client.load(ns, into_dst), 120)
            loads.append(time.perf_counter() - began)
            out["load_ok"] &= r.ok
        torch.cuda.synchronize()
        out["identical_after_rounds"] = bool(torch.equal(src, dst))
        out["ucm_dump_s"] = dumps
        out["ucm_load_s"] = loads

    # Plain cudaMemcpyAsync, same blocks, same process, pinned host memory.
    host = rt.hostAlloc(nbytes, 0)
    stream = rt.streamCreateWithFlags(1)
    try:

        def one_pass(to_device: bool) -> float:
            began = time.perf_counter()
            for i in range(blocks):
                if to_device:
                    rt.memcpyAsync(dst.data_ptr() + i * BLOCK, host + i * BLOCK, BLOCK, 1, stream)
                else:
                    rt.memcpyAsync(host + i * BLOCK, src.data_ptr() + i * BLOCK, BLOCK, 2, stream)
            rt.streamSynchronize(stream)
            return time.perf_counter() - began

        def bulk(to_device: bool) -> float:
            began = time.perf_counter()
            if to_device:
                rt.memcpyAsync(dst.data_ptr(), host, nbytes, 1, stream)
            else:
                rt.memcpyAsync(host, src.data_ptr(), nbytes, 2, stream)
            rt.streamSynchronize(stream)
            return time.perf_counter() - began

        one_pass(False), one_pass(True)  # warm-up
        out["plain_d2h_s"] = [one_pass(False) for _ in range(rounds)]
        out["plain_h2d_s"] = [one_pass(True) for _ in range(rounds)]
        out["bulk_d2h_s"] = [bulk(False) for _ in range(rounds)]
        out["bulk_h2d_s"] = [bulk(True) for _ in range(rounds)]
    finally:
        rt.streamDestroy(stream)
        rt.freeHost(host)
    return out


# -- the orchestrator -------------------------------------------------------------------------------------
def _daemon_phase(
    workdir: Path, args: list[str], phase: str, blocks: int, rounds: int, timeout_s: float
) -> dict[str, Any]:
    from ucm_server.testing.daemon import DaemonProcess

    daemon = DaemonProcess(workdir, args=args)
    result: dict[str, Any] = {"phase": phase, "daemon_args": args}
    began = time.monotonic()
    try:
        daemon.start(timeout_s=120)
        result["daemon_start_s"] = round(time.monotonic() - began, 2)
        cmd = [sys.executable, __file__, "--client", "--target", daemon.target, "--phase", phase]
        cmd += ["--blocks", str(blocks), "--rounds", str(rounds)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            result["error"] = f"client timed out after {timeout_s}s"
            result["client_output"] = (str(exc.stdout or "") + str(exc.stderr or ""))[-3000:]
            return result
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            result["error"] = f"client exited with {proc.returncode}"
            result["client_output"] = (proc.stdout + proc.stderr)[-3000:]
            return result
        result.update(json.loads(lines[-1]))
        return result
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    finally:
        try:
            daemon.stop(timeout_s=30)
        except RuntimeError:
            daemon.kill()
        # Always: it says whether the arena was pinned, and how long that took.
        result["daemon_log"] = daemon.log()[-3000:]


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 2) if seconds else 0.0


def _summary(cache: dict[str, Any], tiered: dict[str, Any]) -> dict[str, Any]:
    nbytes = cache.get("blocks", 0) * BLOCK
    s: dict[str, Any] = {
        "cache_round_trip_identical": bool(cache.get("identical") and cache.get("identical_after_rounds")),
        "tiered_round_trip_identical": bool(tiered.get("identical")),
    }
    if "ucm_dump_s" in cache and "plain_d2h_s" in cache:
        s["plain_d2h_gbps"] = _gbps(nbytes, cache["plain_d2h_s"])
        s["plain_h2d_gbps"] = _gbps(nbytes, cache["plain_h2d_s"])
        s["bulk_d2h_gbps"] = _gbps(nbytes, cache["bulk_d2h_s"])
        s["bulk_h2d_gbps"] = _gbps(nbytes, cache["bulk_h2d_s"])
        s["ucm_dump_gbps"] = _gbps(nbytes, cache["ucm_dump_s"])
        s["ucm_load_gbps"] = _gbps(nbytes, cache["ucm_load_s"])
        s["dump_ratio"] = round(s["ucm_dump_gbps"] / s["plain_d2h_gbps"], 3)
        s["load_ratio"] = round(s["ucm_load_gbps"] / s["plain_h2d_gbps"], 3)
        plain = statistics.median(cache["plain_d2h_s"]) + statistics.median(cache["plain_h2d_s"])
        ucm = statistics.median(cache["ucm_dump_s"]) + statistics.median(cache["ucm_load_s"])
        s["round_trip_ratio"] = round(plain / ucm, 3)
        s["target_met"] = s["round_trip_ratio"] >= 0.8
    return s


def _markdown(report: dict[str, Any]) -> str:
    s, cache = report["summary"], report["cache"]
    n = cache.get("blocks", 0)
    rows = [
        "| what | result |",
        "|---|---|",
        f"| device | {cache.get('device', '?')} (driver {cache.get('driver', '?')}, "
        f"torch {cache.get('torch', '?')}, cupy {cache.get('cupy', '?')}) |",
        "| IPC registration of 2 tensors from a separate client process | "
        f"{cache.get('register_s', '?')} s |",
        f"| {n} x 2 MiB GPU -> daemon Cache -> other GPU tensor, bytes identical | "
        f"{'yes' if s['cache_round_trip_identical'] else 'NO'} |",
        f"| same through Cache\\|Posix, Cache smaller than the data | "
        f"{'yes' if s['tiered_round_trip_identical'] else 'NO'} |",
    ]
    if "dump_ratio" in s:
        rows += [
            "",
            "| transfer, 2 MiB blocks (median) | GB/s | ratio to plain |",
            "|---|---:|---:|",
            f"| plain cudaMemcpyAsync device -> pinned host | {s['plain_d2h_gbps']} | 1 |",
            f"| UCM dump GPU -> daemon Cache (submit to wait) | {s['ucm_dump_gbps']} | {s['dump_ratio']} |",
            f"| plain cudaMemcpyAsync pinned host -> device | {s['plain_h2d_gbps']} | 1 |",
            f"| UCM load daemon Cache -> GPU (submit to wait) | {s['ucm_load_gbps']} | {s['load_ratio']} |",
            f"| round trip (dump + load) | | {s['round_trip_ratio']} (target >= 0.8) |",
            "| one bulk copy of all blocks, for reference | "
            f"d2h {s['bulk_d2h_gbps']} / h2d {s['bulk_h2d_gbps']} | |",
        ]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1024, help="2 MiB blocks per transfer (1024 = 2 GiB)")
    ap.add_argument("--rounds", type=int, default=5, help="timed passes of each kind (median reported)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/ucm-gpu-check"))
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--target", default="", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        print(json.dumps(_client(args.target, args.phase, args.blocks, args.rounds)), flush=True)
        return 0

    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ucm-gpu-check-") as tmp:
        capacity = args.blocks * BLOCK + args.blocks * BLOCK // 4 + 256 * MiB  # data + in-flight replacements
        cache = _daemon_phase(
            Path(tmp) / "cache",
            [*PAGES, "--store-pipeline", "Cache", "--cache-capacity", str(capacity), "--gpu", "on"],
            "cache",
            args.blocks,
            args.rounds,
            300,
        )
        print(f"cache phase done in {time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)
        tiered = _daemon_phase(
            Path(tmp) / "tiered",
            [
                *PAGES,
                "--store-pipeline",
                "Cache|Posix",
                "--cache-capacity",
                "64MiB",
                "--gpu",
                "on",
                "--no-durable",
            ],
            "tiered",
            64,
            1,
            180,
        )
    report = {"summary": _summary(cache, tiered), "cache": cache, "tiered": tiered}
    report["total_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, indent=2, default=str)
    table = _markdown(report)
    (args.out / "gpu_check.json").write_text(text)
    (args.out / "gpu_check.md").write_text(table + "\n")
    print(text)
    print()
    print(table)
    ok = report["summary"]["cache_round_trip_identical"] and report["summary"]["tiered_round_trip_identical"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
