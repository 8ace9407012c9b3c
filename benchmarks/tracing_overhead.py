"""What tracing costs: Lookup latency and Dump/Load throughput with tracing off, on, and on main.

Four variants, each measured in a fresh process whose client and daemon both come from one source
tree (so the client-side hooks are measured too), in alternating order over several rounds so
background load on these shared machines hits them alike:

- ``main``: the tree of ``--base-ref`` (default ``main``, extracted with ``git archive``): no tracing
  code at all, the baseline;
- ``off``: this tree on defaults (``tracing_exporter: off``), what every deployment runs;
- ``unsampled``: this tree, daemon ``tracing_exporter: otlp`` with ``tracing_sample_ratio: 0`` and
  an untraced client (tracing on, recording nothing: the interceptor and tier wrappers still run);
- ``on``: this tree, daemon and client both tracing every call and exporting OTLP/HTTP (batched)
  to a real receiver on loopback that decodes every request (:mod:`ucm_server.testing.otlp_receiver`);
  the client wraps each call in a span, as the connector does.

Each process measures, against baselines of its own run: Lookup of 2,048 keys p50 over a bare gRPC
echo (the health ``Check``) on the same socket; Dump and Load of 256 blocks of 1 MiB (Cache tier,
shared memory) over a memcpy of the same bytes. The table gives each variant's medians over the
rounds and its ratio to ``main``'s: 1.00 is no cost; these machines' noise is about ±5%.

The Dump/Load figures of one variant spread widely between rounds on a busy shared machine (the
table shows each one's lowest and highest round); the ``off`` runs therefore also time each hook
the tracing change added, while tracing is off, by itself: nanoseconds per call, and their sum for
one Load as a share of one Lookup.

Run: ``python -m benchmarks.tracing_overhead`` (``--rounds``, ``--base DIR`` for a tree already made,
``--base-ref`` for another commit without tracing). Six rounds took about 25 minutes here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("main", "off", "unsampled", "on")

MEASURE = r"""
import json, statistics, sys, tempfile, time
from pathlib import Path
import grpc, numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
import ucm_server
from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_server.testing.daemon import DaemonProcess

variant, n, size, repeat, samples, nkeys = sys.argv[1], *map(int, sys.argv[2:7])
NS = namespace_id(bench="tracing")
cache = 2 * n * size + nkeys * (64 << 10) + (64 << 20)  # a 4 KiB block takes a 64 KiB page
args = ["--cache-capacity", str(cache), "--store-pipeline", "Cache"]
span = lambda name: __import__("contextlib").nullcontext()
receiver = None
if variant in ("on", "unsampled"):
    from ucm_server.testing.otlp_receiver import OtlpReceiver
    receiver = OtlpReceiver().__enter__()
    args += ["--tracing-exporter", "otlp", "--tracing-endpoint", receiver.endpoint]
    if variant == "unsampled":
        args += ["--tracing-sample-ratio", "0"]
if variant == "on":
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from ucm_client import tracing
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint)))
    tracing.enable(provider)
    span = lambda name: tracing.request_span(name, request_id="bench")

def blocks(region, count, nbytes, tag):
    return [BlockIO(key_digest(tag, i), (Segment(region, i * nbytes, nbytes),)) for i in range(count)]

out = {"tree": str(Path(ucm_server.__file__).parent.parent)}
with tempfile.TemporaryDirectory(prefix="ucm-trace-bench-") as tmp:
    with DaemonProcess(Path(tmp) / "d", args=args) as d, UcmClient(d.target) as c, \
            SharedBuffer(n * size) as src, SharedBuffer(n * size) as dst, SharedBuffer(nkeys * 4096) as small:
        src.array()[:] = np.random.default_rng(1).integers(0, 255, n * size, dtype=np.uint8)
        rs, rd, rk = c.register(src), c.register(dst), c.register(small)
        bsrc, bdst = blocks(rs, n, size, "b"), blocks(rd, n, size, "b")
        a, b = src.array(), np.empty(n * size, dtype=np.uint8)
        np.copyto(b, a)
        lookup_blocks = blocks(rk, nkeys, 4096, "l")
        assert c.wait(c.dump(NS, lookup_blocks), 60).ok
        keys = [x.key for x in lookup_blocks]

        def dump():
            with span("bench.dump"):
                task = c.dump(NS, bsrc)
            assert c.wait(task, 120).ok

        def load():
            with span("bench.load"):
                task = c.load(NS, bdst)
            assert c.wait(task, 120).ok

        def lookup():
            with span("bench.lookup"):
                assert c.lookup(NS, keys).hit_prefix == nkeys

        with grpc.insecure_channel(d.target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            echo_req = health_pb2.HealthCheckRequest()
            calls = {"echo": lambda: health.Check(echo_req), "lookup": lookup}
            for fn in calls.values():
                for _ in range(20):
                    fn()
            lat = {k: [] for k in calls}
            for _ in range(samples):
                for k, fn in calls.items():
                    t0 = time.perf_counter(); fn(); lat[k].append(time.perf_counter() - t0)
        for _ in range(3):  # warm: the arena's and the regions' pages faulted in on every side
            dump(); load()
        times = {"memcpy": [], "dump": [], "load": []}
        for _ in range(repeat):
            memcpy = lambda: np.copyto(b, a)
            for k, fn in (("memcpy", memcpy), ("dump", dump), ("memcpy", memcpy), ("load", load)):
                t0 = time.perf_counter(); fn(); times[k].append(time.perf_counter() - t0)
        assert bytes(dst.buf[: 1 << 20]) == bytes(src.buf[: 1 << 20])
out.update({f"{k}_p50_ms": statistics.median(v) * 1e3 for k, v in lat.items()})
out.update({f"{k}_gbps": n * size / statistics.median(v) / 1e9 for k, v in times.items()})
if variant == "off":  # what the hooks cost while tracing is off, per call, by the clock (no noise floor)
    import asyncio, timeit
    from ucm_client import tracing as client_hooks
    from ucm_server import tracing as daemon_hooks
    from ucm_server.tasks import TaskKind

    async def body(task):
        return None

    def connector_job():  # a transfer's hooks in the worker: start, submit in its context, end
        client_hooks.job_started(None, parts=1, is_async=False)
        with client_hooks.job_context(None):
            pass
        client_hooks.job_ended(None, good=1, count=1, nbytes=1)

    def carried():
        coro = body(None)
        client_hooks.carry(coro).close()

    hooks = {
        "outgoing": client_hooks.outgoing,
        "carry": carried,
        "connector_job": connector_job,
        "task_body": lambda: daemon_hooks.task_body(TaskKind.LOAD, body),
    }
    for name, fn in hooks.items():
        calls = 100_000
        out[f"hook_{name}_ns"] = min(timeit.repeat(fn, number=calls, repeat=5)) / calls * 1e9
    nocarry = min(timeit.repeat(lambda: body(None).close(), number=100_000, repeat=5)) / 100_000 * 1e9
    out["hook_carry_ns"] -= nocarry  # the coroutine itself is made either way
if variant == "on":
    provider.shutdown()
if receiver is not None:
    time.sleep(0.5)
    out["spans_received"] = len(receiver.spans)
    receiver.__exit__()
print(json.dumps(out))
"""


def measure(
    tree: Path, variant: str, n: int, size: int, repeat: int, samples: int, nkeys: int
) -> dict[str, float]:
    """One variant in a fresh interpreter importing from ``tree`` only (its client and its daemon)."""
    env = {"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-c", MEASURE, variant, *map(str, (n, size, repeat, samples, nkeys))]
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} ({tree}) failed:\n{proc.stderr[-4000:]}")
    figures: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if Path(figures.pop("tree")).resolve() != tree.resolve():
        raise RuntimeError(f"{variant}: imported UCM from somewhere else than {tree}")
    figures["lookup_x_echo"] = figures["lookup_p50_ms"] / figures["echo_p50_ms"]
    figures["dump_x_memcpy"] = figures["dump_gbps"] / figures["memcpy_gbps"]
    figures["load_x_memcpy"] = figures["load_gbps"] / figures["memcpy_gbps"]
    return figures


def base_tree(ref: str, into: Path) -> Path:
    """``ref`` of this repository as a plain tree (``git archive``)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


RATIOS = {
    "lookup_x_echo": "Lookup 2,048 keys p50 / echo",
    "dump_x_memcpy": "Dump / memcpy",
    "load_x_memcpy": "Load / memcpy",
}


def table(
    medians: dict[str, dict[str, float]], rounds: int, ref: str, runs: dict[str, list[dict[str, float]]]
) -> str:
    lines = [
        f"**Tracing overhead: medians of {rounds} interleaved rounds; in brackets, the ratio to the base's "
        "figure, a tree without tracing (1.00 = no cost; Lookup: lower is better, Dump/Load: higher is "
        "better)**",
        "",
        "| measurement | " + " | ".join(f"base (`{ref}`)" if v == "main" else v for v in VARIANTS) + " |",
        "|---|" + "---|" * len(VARIANTS),
    ]
    for key, label in RATIOS.items():
        base = medians["main"][key]
        cells = [
            f"{medians[v][key]:.3f}" + ("" if v == "main" else f" ({medians[v][key] / base:.2f})")
            for v in VARIANTS
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for key in ("dump_x_memcpy", "load_x_memcpy"):  # how far apart the rounds are: the noise floor
        spread = [f"{min(r[key] for r in runs[v]):.2f}–{max(r[key] for r in runs[v]):.2f}" for v in VARIANTS]
        lines.append(f"| … {RATIOS[key]}, lowest–highest round | " + " | ".join(spread) + " |")
    lines.append(
        "| Lookup p50 (ms) | " + " | ".join(f"{medians[v]['lookup_p50_ms']:.3f}" for v in VARIANTS) + " |"
    )
    lines.append(
        "| spans received | "
        + " | ".join(f"{medians[v].get('spans_received', 0):.0f}" for v in VARIANTS)
        + " |"
    )
    off = medians["off"]
    per_load = sum(off[f"hook_{h}_ns"] for h in ("outgoing", "carry", "connector_job", "task_body"))
    lines += [
        "",
        "**What tracing's hooks cost while it is off, per call (min of 5 × 100,000 calls, `off` runs)**",
        "",
        "| hook | ns per call |",
        "|---|---|",
        f"| `ucm_client.tracing.outgoing()` (each call's metadata) | {off['hook_outgoing_ns']:.0f} |",
        f"| `ucm_client.tracing.carry()` (each blocking call) | {off['hook_carry_ns']:.0f} |",
        f"| a connector transfer's hooks (start, context, end) | {off['hook_connector_job_ns']:.0f} |",
        f"| `ucm_server.tracing.task_body()` (each task) | {off['hook_task_body_ns']:.0f} |",
        f"| all of them once (one Load from the connector) | {per_load:.0f} "
        f"({per_load / (off['lookup_p50_ms'] * 1e6) * 100:.3f}% of one Lookup's p50) |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--base-ref",
        default="main",
        help="git ref of a tree without tracing (default: main; once it has tracing, the commit before)",
    )
    p.add_argument("--base", type=Path, help="a baseline tree already extracted (instead of --base-ref)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-bytes", type=int, default=1 << 20)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--lookup-keys", type=int, default=2048)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tracing_overhead.md")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ucm-trace-base-") as tmp:
        base = a.base.resolve() if a.base else base_tree(a.base_ref, Path(tmp))
        trees = {"main": base, "off": ROOT, "unsampled": ROOT, "on": ROOT}
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
        for r in range(a.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                figures = measure(
                    trees[variant], variant, a.blocks, a.block_bytes, a.repeat, a.samples, a.lookup_keys
                )
                runs[variant].append(figures)
                shown = {k: round(figures[k], 3) for k in RATIOS}
                print(f"round {r} {variant}: {shown}", file=sys.stderr, flush=True)
    medians = {v: {k: statistics.median(run[k] for run in runs[v]) for k in runs[v][0]} for v in VARIANTS}
    md = table(medians, a.rounds, a.base_ref if not a.base else str(a.base), runs)
    print(md)
    print(json.dumps({"medians": medians, "runs": runs}, indent=2), file=sys.stderr)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
