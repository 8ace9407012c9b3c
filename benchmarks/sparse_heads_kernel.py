"""How to let each KV head attend to its own blocks on vLLM's CPU kernel: the options, measured.

vLLM's ``cpu_attention_with_kv_cache`` takes one block table per sequence. Ways to give each KV head
its own blocks at a decode step (two requests, Llama-3-8B attention: 32 query / 8 KV heads of 128,
float32, block 128, a 20% budget, one thread):

- *dense*: every block, one shared table (the baseline);
- *one table*: the selected blocks, one table for all heads (what fits the kernel as it is; the
  heads cannot differ);
- *per KV head, one call*: the cache viewed per (block, head) page, each (request, KV head) one
  sequence with its query group and its own table (what the sparse backend runs);
- *per KV head, a call each*: the same view, one kernel call per KV head;
- *gather + torch*: each head's selected pages copied out, then softmax attention in torch.

Each row is the median of ``--repeat`` timed calls after a warm-up; *vs dense* is dense's median over
the row's, measured back to back in the same run.

Run: ``python -m benchmarks.sparse_heads_kernel`` (writes ``benchmarks/results/sparse_heads_kernel.md``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "sparse_heads_kernel.md"
HEADS, KV_HEADS, DIM, BLOCK, ROWS = 32, 8, 128, 128, 2


def _timed(call: Callable[[], Any], repeat: int) -> float:
    call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _rows(tokens: int, ratio: float, repeat: int) -> list[tuple[str, float]]:
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = torch.float32
    isa = _get_attn_isa(dtype, BLOCK, DIM)
    gen = torch.Generator().manual_seed(0)
    blocks = tokens // BLOCK
    cache = torch.randn(ROWS * blocks, KV_HEADS, BLOCK, 2 * DIM, generator=gen)
    key_cache, value_cache = cache.view(ROWS * blocks, KV_HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
    pages = cache.view(ROWS * blocks * KV_HEADS, 1, 2 * BLOCK, DIM)
    key_pages, value_pages = pages.chunk(2, dim=2)
    query = torch.randn(ROWS, HEADS, DIM, generator=gen)
    table = torch.arange(ROWS * blocks, dtype=torch.int32).view(ROWS, blocks)
    keep = max(4, math.ceil(ratio * blocks))
    shared = torch.stack([torch.randperm(blocks, generator=gen)[:keep].sort().values for _ in range(ROWS)])
    per_head = torch.stack(
        [torch.randperm(blocks, generator=gen)[:keep].sort().values for _ in range(ROWS * KV_HEADS)]
    ).view(ROWS, KV_HEADS, keep)
    physical = table[:, None, :].expand(ROWS, KV_HEADS, blocks).gather(2, per_head)
    head_table = (physical * KV_HEADS + torch.arange(KV_HEADS)[None, :, None]).view(ROWS * KV_HEADS, keep)
    head_table = head_table.to(torch.int32)
    group = HEADS // KV_HEADS

    def attend(q: Any, keys: Any, values: Any, heads: int, kv_heads: int, lens: Any, tables: Any) -> Any:
        starts = torch.arange(lens.numel() + 1, dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=lens.numel(),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=DIM,
            seq_lens=lens,
            dtype=dtype,
            query_start_loc=starts,
            causal=True,
            sliding_window_size=-1,
            isa=isa,
            enable_kv_split=False,
        )
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=keys,
            value_cache=values,
            output=out,
            query_start_loc=starts,
            seq_lens=lens,
            scale=DIM**-0.5,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=tables,
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
        )
        return out

    full = torch.full((ROWS,), tokens, dtype=torch.int32)
    kept = torch.full((ROWS,), keep * BLOCK, dtype=torch.int32)
    kept_heads = torch.full((ROWS * KV_HEADS,), keep * BLOCK, dtype=torch.int32)
    one_table = table.gather(1, shared).contiguous()
    q_heads = query.view(ROWS * KV_HEADS, group, DIM)

    def per_call() -> None:
        tables = head_table.view(ROWS, KV_HEADS, keep)
        for head in range(KV_HEADS):
            q = query[:, head * group : (head + 1) * group].contiguous()
            attend(q, key_pages, value_pages, group, 1, kept, tables[:, head].contiguous())

    def gather() -> Any:
        flat = head_table.view(-1).long()
        k = key_pages[flat].view(ROWS * KV_HEADS, keep * BLOCK, DIM)  # a copy of the selected pages
        v = value_pages[flat].view(ROWS * KV_HEADS, keep * BLOCK, DIM)
        probs = torch.softmax(torch.bmm(q_heads, k.transpose(1, 2)) * DIM**-0.5, dim=-1)
        return torch.bmm(probs, v)

    return [
        (
            "dense",
            _timed(lambda: attend(query, key_cache, value_cache, HEADS, KV_HEADS, full, table), repeat),
        ),
        (
            "one table",
            _timed(lambda: attend(query, key_cache, value_cache, HEADS, KV_HEADS, kept, one_table), repeat),
        ),
        (
            "per KV head, one call",
            _timed(lambda: attend(q_heads, key_pages, value_pages, group, 1, kept_heads, head_table), repeat),
        ),
        ("per KV head, a call each", _timed(per_call, repeat)),
        ("gather + torch", _timed(gather, repeat)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    torch.set_num_threads(1)
    lines = [
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        "| tokens | way | ms per call (2 requests) | vs dense |",
        "|---|---|---|---|",
    ]
    for tokens in args.tokens:
        rows = _rows(tokens, args.ratio, args.repeat)
        dense = rows[0][1]
        for way, ms in rows:
            lines.append(f"| {tokens // 1024}k | {way} | {ms:.2f} | {dense / ms:.2f}× |")
            print(lines[-1], flush=True)
    lines += [
        "",
        f"Machine load average (1 / 5 / 15 min) at the end of this run, on 2 shared cores:"
        f" {' / '.join(f'{x:.1f}' for x in os.getloadavg())}.",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
