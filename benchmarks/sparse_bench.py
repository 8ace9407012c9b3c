"""Sparse attention benchmark: decode attention time and KV bytes read vs dense, plus needle accuracy.

Workload: one decode query over a planted-needle context (``ucm_client.sparse.testing``) shaped like a
Llama-3-8B layer (32 query heads, 8 KV heads, head_dim 128, float32), 128-token blocks, at 8k, 16k and
32k tokens. For each method:
- *step ms*: one decode step, best of ``--repeat`` runs (the least disturbed on a shared box), with
  retrieval on every step (the worst case; a ``retrieval_stride`` of s divides the retrieval part
  by s). Block features are computed before timing, as they are at prefill.
- *dense ms*: exact dense attention over the same KV, measured right before the method's step (the
  machine is shared; only back-to-back ratios are meaningful); *speed-up* = dense / step.
- *KV read*: bytes of K and V the step attends to; *index read*: bytes of block features read by
  retrieval, in the storage our implementation uses (GSA: 128 sign bits as two int64 words).
- *recall*: fraction of needle blocks selected; *rel. err*: ``||out - dense|| / ||dense||``.
ReRoPE is not a sparsifier: it attends to every token with clamped positions beyond its window
(25% of the context here), so its row reports its cost over plain RoPE attention (keys pre-rotated
for the baseline; ReRoPE rotates the window's keys inside the step) and whether needles planted
beyond the window are still the most-attended tokens. Blend is a prefill method; its benchmark is
``benchmarks/blend_bench.py`` (results in ``docs/sparse.md``, Blend).

Run: ``python -m benchmarks.sparse_bench`` (writes ``benchmarks/results/sparse.md`` and prints it).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.config import BlockBudget
from ucm_client.sparse.factory import UcmSparseFactory
from ucm_client.sparse.kernels.attention import causal_attention, dense_decode_attention
from ucm_client.sparse.methods.block_sparse import BlockSparseMethod, DecodeState
from ucm_client.sparse.methods.rerope import rerope_attention, rerope_logits
from ucm_client.sparse.quality import CONTROLS, assess
from ucm_client.sparse.rope import apply_rope
from ucm_client.sparse.testing import NeedleCase, drifting_needles, planted_needles, relative_error

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 128
RESULTS = Path(__file__).parent / "results" / "sparse.md"


def _best_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _block_rows(case: NeedleCase, tokens: int, ratio: float, repeat: int) -> list[str]:
    rows = []
    kv_bytes_per_token = 2 * KV_HEADS * DIM * 4
    dense_out = dense_decode_attention(case.query, case.keys, case.values, case.scale)
    for name in ("ESA", "GSA", "KVStarMultiStep"):
        method = UcmSparseFactory.create_sparse_method(
            name, UcmSparseRole.WORKER, {"sparse_ratio": ratio, "retrieval_stride": 1, "block_size": BLOCK}
        )
        assert isinstance(method, BlockSparseMethod)
        state = DecodeState()

        def step(method: BlockSparseMethod = method, state: DecodeState = state) -> object:
            return method.decode(
                case.query, case.keys, case.values, state=state, block_size=BLOCK, scale=case.scale
            )

        res = method.decode(
            case.query, case.keys, case.values, state=state, block_size=BLOCK, scale=case.scale
        )
        # Dense is re-measured next to each method: this machine is shared, so only ratios taken
        # back to back mean anything.
        dense_ms = _best_ms(
            lambda: dense_decode_attention(case.query, case.keys, case.values, case.scale), repeat
        )
        ms = _best_ms(step, repeat)
        assert state.features is not None
        index_bytes = state.features.numel() * state.features.element_size()
        rows.append(
            f"| {name} | {tokens // 1024}k | {ratio:.0%} of blocks | {ms:.1f} | {dense_ms:.1f} | "
            f"{dense_ms / ms:.2f}× | {_mib(res.token_idx.numel() * kv_bytes_per_token)} "
            f"({res.token_idx.numel() / tokens:.0%}) | {_mib(index_bytes)} | "
            f"{case.recall(res.block_ids):.2f} | {relative_error(res.output, dense_out):.1e} |"
        )
    return rows


def _first_step_rows(case: NeedleCase, tokens: int, ratio: float) -> list[str]:
    """The first sparse decode step with features built at prefill, and without."""
    rows = []
    for name in ("ESA", "GSA", "KVStarMultiStep"):
        method = UcmSparseFactory.create_sparse_method(name, UcmSparseRole.WORKER, {"sparse_ratio": ratio})
        assert isinstance(method, BlockSparseMethod)

        def first(prebuilt: bool, method: BlockSparseMethod = method) -> tuple[float, float]:
            state = DecodeState()
            start = time.perf_counter()
            if prebuilt:  # what the worker does after each prefill layer
                method.extend_features(state, tokens, BLOCK, lambda a, b: case.keys[a:b])
            built = time.perf_counter()
            method.decode(case.query, case.keys, case.values, state=state, block_size=BLOCK, scale=case.scale)
            return 1e3 * (built - start), 1e3 * (time.perf_counter() - built)

        first(True)  # warm
        prefill_ms, step_ms = min(first(True) for _ in range(2))
        _, cold_ms = min(first(False) for _ in range(2))
        rows.append(f"| {name} | {tokens // 1024}k | {prefill_ms:.1f} | {step_ms:.1f} | {cold_ms:.1f} |")
    return rows


def _rerope_row(case: NeedleCase, tokens: int, repeat: int) -> str:
    # Pre-RoPE keys are the case's keys; plain RoPE attention is the baseline.
    window = tokens // 4
    q_pos = torch.tensor([tokens - 1])
    k_pos = torch.arange(tokens)
    q = case.query[None]
    keys, values = case.keys, case.values
    # plant the needles as keys that R(window)·q prefers, so "retrieved" has a meaning
    group_mean = q.view(1, KV_HEADS, HEADS // KV_HEADS, DIM).mean(2)
    target = apply_rope(group_mean, torch.tensor([float(window)]))[0]
    far_blocks = case.needle_blocks[case.needle_blocks * BLOCK + BLOCK <= tokens - window]
    needle_tokens = (far_blocks[:, None] * BLOCK + torch.arange(4)).flatten()  # beyond the window only
    keys = keys.clone()
    keys[needle_tokens] = 24.0 * target / target.norm(dim=-1, keepdim=True)
    k_rot = apply_rope(keys, k_pos)
    q_rot = apply_rope(q, q_pos)
    base_ms = _best_ms(lambda: causal_attention(q_rot, q_pos, k_rot, values, k_pos, scale=case.scale), repeat)
    ms = _best_ms(lambda: rerope_attention(q, q_pos, keys, values, k_pos, window=window), repeat)
    logits = rerope_logits(q, q_pos, keys, k_pos, window=window).mean(dim=(0, 1))[0]
    top = torch.topk(logits, needle_tokens.numel()).indices
    recall = float(torch.isin(needle_tokens, top).float().mean())
    kv = _mib(tokens * 2 * KV_HEADS * DIM * 4)
    return (
        f"| ReRoPE | {tokens // 1024}k | window {window} (25%) | {ms:.1f} | {base_ms:.1f} (RoPE) | "
        f"{base_ms / ms:.2f}× | {kv} (100%) | 0 | {recall:.2f} | n/a (positions differ by design) |"
    )


QUALITY_PATTERNS: dict[str, dict[str, Any]] = {
    "spread (4 tokens)": {"num_needles": 6},
    "single token": {"num_needles": 6, "needle_tokens": 1},
    "per KV head": {"num_needles": 2, "per_head": True},
    "distractors": {"num_needles": 6, "distractors": 12},
}


def _quality_rows(ratio: float, seeds: int) -> list[str]:
    """Each pattern at 8k, per-KV-head selection, and the negative controls.

    Figures are means over ``seeds`` seeds; *pass* is ``Quality.passes`` on every seed (recall >= 0.95
    and error <= 1.25x the oracle's + 0.005). Drift: 12 steps with each method's default stride, the
    worst step's recall and the number of steps passing.
    """
    shape = {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": DIM, "block_size": BLOCK}
    tokens = 8192
    rows = []
    keep = BlockBudget(ratio, 1, 2, 4).num_kept(tokens // BLOCK)
    for pattern, kw in QUALITY_PATTERNS.items():
        cases = [planted_needles(tokens, seed=seed, **shape, **kw) for seed in range(seeds)]
        selectors: dict[str, Callable[[NeedleCase], tuple[torch.Tensor, torch.Tensor | None]]] = {}
        for name, per_head in [(m, p) for m in ("ESA", "GSA", "KVStarMultiStep") for p in (True, False)]:
            method = UcmSparseFactory.create_sparse_method(
                name, UcmSparseRole.WORKER, {"sparse_ratio": ratio}
            )
            assert isinstance(method, BlockSparseMethod)

            def run(
                case: NeedleCase, method: BlockSparseMethod = method, per_head: bool = per_head
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
                res = method.decode(
                    case.query,
                    case.keys,
                    case.values,
                    state=DecodeState(),
                    block_size=BLOCK,
                    scale=case.scale,
                    per_head=per_head,
                )
                return res.block_ids, res.output

            selectors[name if per_head else f"{name}, one list for all heads (vLLM)"] = run
        for control, fn in CONTROLS.items():
            selectors[f"control: {control}"] = lambda case, fn=fn: (fn(case, keep), None)
        for name, select in selectors.items():
            qs = [assess(case, *select(case)) for case in cases]
            recall, error = sum(q.recall for q in qs) / len(qs), sum(q.error for q in qs) / len(qs)
            oracle = sum(q.oracle_error for q in qs) / len(qs)
            verdict = "yes" if all(q.passes for q in qs) else "no"
            rows.append(f"| {pattern} | {name} | {recall:.2f} | {error:.3f} | {oracle:.3f} | {verdict} |")
    for name in ("ESA", "GSA", "KVStarMultiStep"):
        worst, passed, total = 1.0, 0, 0
        for seed in range(seeds):
            method = UcmSparseFactory.create_sparse_method(
                name, UcmSparseRole.WORKER, {"sparse_ratio": ratio}
            )
            assert isinstance(method, BlockSparseMethod)
            state = DecodeState()
            for case in drifting_needles(tokens, seed=seed, steps=12, num_needles=4, **shape):
                res = method.decode(
                    case.query,
                    case.keys,
                    case.values,
                    state=state,
                    block_size=BLOCK,
                    scale=case.scale,
                    per_head=True,
                )
                q = assess(case, res.block_ids, res.output)
                worst, passed, total = min(worst, q.recall), passed + q.passes, total + 1
        rows.append(f"| drift, 12 steps | {name} | worst step {worst:.2f} | | | {passed}/{total} steps |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared box)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds of the quality table (0: skip it)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    header = [
        f"Decode attention, one query, {HEADS} q heads / {KV_HEADS} KV heads, head_dim {DIM}, float32, "
        f"block {BLOCK}, {torch.get_num_threads()} torch thread(s); best of {args.repeat} runs (a shared "
        "2-core machine: the minimum is the least disturbed run, and only the back-to-back ratio "
        "sparse/dense is comparable across rows); retrieval on every step.",
        "",
        "| method | tokens | budget | step ms | dense ms | speed-up | KV read (share) | index read | "
        "needle recall | rel. err vs dense |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    quality = [
        "",
        f"Selection quality at 8k tokens, {args.ratio:.0%} budget, per-KV-head selection, mean of "
        f"{args.seeds} seeds (`ucm_client.sparse.quality`; the same assertions as "
        "`tests/sparse/test_sparse_quality.py`):",
        "",
        "| pattern | selector | needle recall | rel. err | oracle err | passes |",
        "|---|---|---|---|---|---|",
        *(_quality_rows(args.ratio, args.seeds) if args.seeds else ["| (skipped) | | | | | |"]),
    ]
    first_rows = [
        "",
        "First sparse decode step per layer: block features built during prefill "
        "(the worker features each layer's blocks after its attention wrote them) vs built by the first "
        "retrieval. Best of 2, ms.",
        "",
        "| method | tokens | features at prefill | first step, prebuilt | first step, not prebuilt |",
        "|---|---|---|---|---|",
    ]
    rows = []
    for tokens in args.tokens:
        case = planted_needles(
            tokens,
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=DIM,
            block_size=BLOCK,
            num_needles=8,
            needle_tokens=4,
            seed=tokens,
        )
        rows += _block_rows(case, tokens, args.ratio, args.repeat)
        rows.append(_rerope_row(case, tokens, args.repeat))
        first_rows += _first_step_rows(case, tokens, args.ratio)
    footer = [
        "",
        "GSA scans every token's code each retrieval: 256 bits = four uint64 words per key and head, XOR, "
        "masked to the half of the bits the query is most sure of, popcount and the best token per "
        "block in one compiled pass (`ucm_client/sparse/kernels/scoring.py`; GSAOnDevice: torch SWAR ops "
        "on the cache's device). Its index is 32 bytes per key and head (512 for the float32 key), the "
        "*index read* column. ESA keeps int8 channel-major key codes (a scale per block and channel) and "
        "reads the query's 16 largest channels of every token in one compiled pass per block; KVStar "
        "the same over its kept channels (all by default), for each recent query.",
        "Blend (prefill) is measured by `python -m benchmarks.blend_bench` over model shapes it was not "
        "tuned on, against a random selection of the same size; results in `docs/sparse.md` (Blend).",
    ]
    text = "\n".join(header + rows + footer + first_rows + quality) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
