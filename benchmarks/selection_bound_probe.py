"""Can a Quest-style block bound make sparse selection cheap? Measured on the sparse benchmark's workloads.

Per block, KV head and channel the largest and smallest key bound ``q·k`` over the block from above:
``Σ_d max(q_d·kmax_d, q_d·kmin_d)``. Three uses were proposed to cut selection cost: (a) keep
the last selection while its blocks' bounds dominate the unselected ones, (b) a shortlist before
token scoring, exact when the k-th token-level score of the shortlist is at least the best bound
outside it, (c) the bound as the score. This probe measures what each needs, at 128-token blocks:

- *prunable*: share of blocks whose bound (over the query's scoring channels, clamped at 0 as ESA's
  shrunk scores can be) lies below the k-th best ESA score at a 20% budget; only those blocks can be
  skipped by a certified shortlist (b), and only a bound that falls below selected scores lets (a)
  keep a selection;
- *needle z (min)* and *haystack z (max)*: the bound of needle blocks and of the best non-needle
  block, in robust z-scores (median, MAD) of all blocks' bounds; (c) or a bound-based drift test
  needs needle blocks to stand out (min needle z above max haystack z);
- *token-scoring floor*: bytes a token-level retrieval reads (16 float16 channels of every key per
  KV head), the memory traffic any retrieval that scores tokens pays.

Run: ``python -m benchmarks.selection_bound_probe`` (writes ``benchmarks/results/selection_bound.md``).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.kernels.attention import group_query
from ucm_client.sparse.methods.block_sparse import DecodeState
from ucm_client.sparse.methods.esa import ESA
from ucm_client.sparse.testing import planted_needles

RESULTS = Path(__file__).parent / "results" / "selection_bound.md"
BLOCK, CHANNELS = 128, 16


def block_bounds(keys: torch.Tensor, q: torch.Tensor, block_size: int, channels: int) -> torch.Tensor:
    """Upper bounds ``[H, m]`` of each KV head's query ``q`` ``[H, D]`` over its ``channels`` largest."""
    m = keys.shape[0] // block_size
    kb = keys[: m * block_size].reshape(m, block_size, keys.shape[1], -1)
    kmax, kmin = kb.amax(dim=1), kb.amin(dim=1)  # [m, H, D]
    chosen = torch.topk(q.abs(), channels, dim=-1).indices
    qm = torch.zeros_like(q).scatter_(1, chosen, q.gather(1, chosen))
    return torch.maximum(qm[None] * kmax, qm[None] * kmin).sum(dim=-1).T


def robust_z(x: torch.Tensor) -> torch.Tensor:
    med = x.median(dim=-1, keepdim=True).values
    mad = (x - med).abs().median(dim=-1, keepdim=True).values.clamp_min(1e-12) * 1.4826
    return (x - med) / mad


def probe(
    keys: torch.Tensor, query: torch.Tensor, mask: torch.Tensor | None, ratio: float
) -> dict[str, float]:
    """The figures of one case; ``mask`` ``[H, m]`` marks needle blocks (``None``: no needles)."""
    heads = keys.shape[1]
    esa = ESA(UcmSparseRole.WORKER, {"sparse_ratio": ratio})
    state = DecodeState()
    esa.extend_features(state, keys.shape[0], BLOCK, lambda a, b: keys[a:b])
    assert state.features is not None
    exact = esa._score(query[None], state.features, state) * math.sqrt(keys.shape[-1])  # [H, m]
    q = group_query(query.float(), heads).sum(dim=1)
    bound = block_bounds(keys.float(), q, BLOCK, CHANNELS).clamp_min(0)
    keep = esa._budget.num_kept(exact.shape[1])
    kth = exact.topk(keep, dim=-1).values[:, -1:]
    z = robust_z(bound)
    out = {
        "prunable": float((bound < kth).float().mean()),
        "bound/kth": float(bound.median() / kth.mean()),
    }
    if mask is not None:
        m = mask[:, : z.shape[1]]
        out["needle_z_min"] = float(z[m].min())
        out["haystack_z_max"] = float(z[~m].max())
    else:
        out["needle_z_min"] = float("nan")
        out["haystack_z_max"] = float(z.max())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    keys = torch.randn(32768, 8, 64)
    rows.append(
        (
            "random haystack (vLLM bench shape: 32k, 8 KV heads, D 64)",
            probe(keys, torch.randn(8, 64), None, args.ratio),
        )
    )
    for label, kwargs in [
        ("single-token needles (8k, 32/8 heads, D 128)", {}),
        ("per-KV-head needles", {"per_head": True}),
        ("needles + loud distractors", {"num_needles": 6, "distractors": 12}),
    ]:
        case = planted_needles(
            8192, num_heads=32, num_kv_heads=8, head_dim=128, block_size=BLOCK, needle_tokens=1, **kwargs
        )  # type: ignore[arg-type]
        rows.append((label, probe(case.keys, case.query, case.mask(), args.ratio)))
    floor = 32768 * 8 * CHANNELS * 2
    lines = [
        "Quest-style block bounds at 128-token blocks, 20% budget "
        "(``python -m benchmarks.selection_bound_probe``; see the module docstring for the columns).",
        "",
        "| case | prunable (certified shortlist) | median bound / k-th score "
        "| needle z (min) | haystack z (max) |",
        "|---|---|---|---|---|",
    ]
    for label, r in rows:
        lines.append(
            f"| {label} | {r['prunable']:.1%} | {r['bound/kth']:.2f} "
            f"| {r['needle_z_min']:.2f} | {r['haystack_z_max']:.2f} |"
        )
    lines += [
        "",
        f"Token-scoring floor at 32k tokens, 8 KV heads: {floor / 2**20:.0f} MiB read "
        "per retrieval and request-layer.",
    ]
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
