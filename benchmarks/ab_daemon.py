"""Interleaved A/B of the daemon benchmark's measurements between two source trees.

On these shared 2-core machines one run of :mod:`benchmarks.daemon_bench` moves by more than most
changes gain (Lookup/echo 1.2–1.7×, Dump/memcpy 0.67–1.04× within fifteen minutes). This runs the
same measurement from two trees in alternating order (A B, B A, ...), each in its own process
started from its own tree, and prints the median, min and max of each ratio per tree, so background
load hits both sides alike. Make the other tree with ``git archive <commit> | tar -x -C DIR``.

Run: ``python -m benchmarks.ab_daemon --base /tmp/base --what lookup --rounds 8``. The base tree runs
this tree's :mod:`benchmarks.daemon_bench` (copy it there) when it lacks a measurement; its clients
are then plain gRPC clients.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEASURES = {
    "lookup": (
        "lookup_latency(pathlib.Path(t), 2048, 200)",
        {
            "raw_x": ("lookup_raw_p50_ms", "echo_p50_ms"),
            "client_x": ("lookup_client_p50_ms", "echo_p50_ms"),
        },
    ),
    "copy": (
        "daemon_throughput(pathlib.Path(t), 256, 1 << 20, 7)",
        {"dump_x": ("dump_gbps", "memcpy_gbps"), "load_x": ("load_gbps", "memcpy_gbps")},
    ),
    "small": (
        "daemon_throughput(pathlib.Path(t), 4096, 64 << 10, 5)",
        {"dump_x": ("dump_gbps", "memcpy_gbps"), "load_x": ("load_gbps", "memcpy_gbps")},
    ),
    "two": (
        "two_clients(pathlib.Path(t), 4096, 64 << 10, 4)",
        {"two_vs_one": ("two_clients_gbps", "one_client_gbps")},
    ),
}


def measure(tree: Path, what: str) -> dict[str, float]:
    """One measurement in a fresh interpreter whose imports come from ``tree`` only."""
    call, ratios = MEASURES[what]
    code = (
        "import json, pathlib, tempfile\n"
        "from benchmarks.daemon_bench import daemon_throughput, lookup_latency, two_clients\n"
        "if __name__ == '__main__':\n"
        "    with tempfile.TemporaryDirectory() as t:\n"
        f"        print(json.dumps({call}))\n"
    )
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-c", code]
    out = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=600, check=True)
    figures: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    for name, (num, den) in ratios.items():
        figures[name] = figures[num] / figures[den]
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the other tree (A)")
    p.add_argument("--new", type=Path, default=ROOT, help="this tree by default (B)")
    p.add_argument("--what", choices=sorted(MEASURES), default="lookup")
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args(argv)
    trees = {"base": a.base.resolve(), "new": a.new.resolve()}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for r in range(a.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
        for name, tree in order:
            figures = measure(tree, a.what)
            results[name].append(figures)
            shown = {k: round(v, 3) for k, v in figures.items() if k in MEASURES[a.what][1]}
            print(f"round {r} {name}: {shown}", flush=True)
    for name, runs in results.items():
        for key in MEASURES[a.what][1]:
            values = [run[key] for run in runs]
            spread = f"min {min(values):.3f}, max {max(values):.3f}"
            print(f"{name} {key}: median {statistics.median(values):.3f} ({spread})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
