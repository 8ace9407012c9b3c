"""Compression at rest: capacity, speed and accuracy of the fp8 e4m3 codec.

``python -m benchmarks.codec_bench`` prints markdown tables and writes ``benchmarks/results/codec.md``:

- *capacity*: bytes a 2 MiB (and a 64 KiB) KV block takes on the Posix tier, raw / encoded;
- *codec alone, one core*: encode and decode GB/s of original bytes (``codec.encode`` /
  ``decode_into``) on KV-like bf16 and fp16 blocks, best of ``--repeats``;
- *through the tier*: dump and load GB/s of the Posix tier with and without the wrapper
  (``durable=False``: the page cache serves, the worst case for the codec's share);
- *accuracy*: the relative error of dense decode attention outputs (the sparse benchmark's
  planted-needle data, Llama-3-8B layer shape) with K and V stored in bf16 vs through the codec,
  and whether the needles stay the most-attended blocks, beside the codec's per-element bound.

The machine is shared (2 CPUs): only figures measured back to back compare.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.results_file import publish
from benchmarks.tier_rates import parser, tier_rates
from ucm_client.sparse.kernels.attention import dense_decode_attention
from ucm_client.sparse.testing import planted_needles, relative_error
from ucm_server.store import codec
from ucm_server.store.base import Tier
from ucm_server.store.compressed import CompressedTier
from ucm_server.store.posix import PosixTier

NS = b"codec-bench-ns!!"
HEADS, KV_HEADS, DIM, BLOCK_TOKENS = 32, 8, 128, 128


def kv_like(size: int, dtype: str, seed: int = 0) -> bytes:
    """Normal values with a range per 4 KiB (heads differ), as a KV block's."""
    rng = np.random.default_rng(seed)
    n = size // 2
    x = rng.standard_normal(n) * np.repeat(np.exp(rng.uniform(-3, 3, -(-n // 2048))), 2048)[:n]
    if dtype == "float16":
        return x.astype(np.float16).tobytes()
    f = x.astype(np.float32).view(np.uint32)
    return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def codec_rates(size: int, repeats: int) -> list[str]:
    rows = []
    for dtype in ("bfloat16", "float16"):
        data = kv_like(size, dtype)
        encoded = codec.encode(data, dtype)
        assert encoded is not None
        out = memoryview(bytearray(size))
        enc = size / _best(lambda d=data, t=dtype: codec.encode(d, t), repeats)  # type: ignore[misc]
        dec = size / _best(lambda e=encoded, o=out: codec.decode_into(e, o), repeats)  # type: ignore[misc]
        rows.append(f"| codec alone, one core, {dtype} | {enc / 1e9:.2f} | {dec / 1e9:.2f} |")
    return rows


async def tier_rows(blocks: int, size: int, repeats: int) -> tuple[list[str], list[str]]:
    rows, capacity = [], []
    stored_by: dict[str, int] = {}
    for name in ("Posix", "Posix + fp8_e4m3"):
        with tempfile.TemporaryDirectory(prefix="ucm-codec-") as tmp:
            posix = PosixTier(roots=[Path(tmp)], durable=False, direct_io=False)
            tier: Tier = posix if name == "Posix" else CompressedTier(posix, "bfloat16")
            await tier.open()
            try:
                data = memoryview(kv_like(size, "bfloat16"))
                w, r, stored = await tier_rates(tier, NS, data, blocks, repeats, exact=name == "Posix")
            finally:
                await tier.close()
        stored_by[name] = stored
        rows.append(f"| {name} (dump / load) | {w / 1e9:.2f} | {r / 1e9:.2f} |")
    raw, enc = stored_by["Posix"], stored_by["Posix + fp8_e4m3"]
    capacity.append(
        f"| {blocks} × {size >> 20} MiB on Posix | {raw / blocks:,.0f} | {enc / blocks:,.0f} | "
        f"{raw / enc:.3f}× |"
    )
    small = 64 << 10
    capacity.append(
        f"| one 64 KiB block (payload) | {small:,} | {codec.encoded_size(small):,} | "
        f"{small / (codec.encoded_size(small) or 1):.3f}× |"
    )
    return rows, capacity


def _through_codec(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``t`` (bf16) stored as 128-token blocks through the codec and read back, and the largest
    per-element error over the documented bound (<= 1 holds the bound)."""
    flat = t.contiguous().view(torch.int16).numpy().view(np.uint16)
    per_block = flat.reshape(-1, BLOCK_TOKENS * KV_HEADS * DIM)
    out = np.empty_like(per_block)
    worst = 0.0
    for i, row in enumerate(per_block):
        encoded = codec.encode(row.tobytes(), "bfloat16")
        assert encoded is not None
        codec.decode_into(encoded, memoryview(out[i]).cast("B"))
        x = (row.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        y = (out[i].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        worst = max(worst, float((np.abs(y - x) / codec.error_bound(x)).max()))
    back = torch.from_numpy(out.reshape(flat.shape).view(np.int16)).view(torch.bfloat16).reshape(t.shape)
    return back, worst


def attention_error(tokens: int) -> tuple[float, float, float, bool]:
    """On ``tokens`` of planted-needle data: (rel. error of attention outputs, codec vs bf16; bf16
    vs fp32; worst per-element error over the bound; whether the needles stay the most-attended)."""
    case = planted_needles(
        tokens, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BLOCK_TOKENS, seed=1
    )
    k16, v16 = case.keys.to(torch.bfloat16), case.values.to(torch.bfloat16)
    k8, kw = _through_codec(k16)
    v8, vw = _through_codec(v16)
    q = case.query
    exact = dense_decode_attention(q, k16.float(), v16.float(), case.scale)
    err = relative_error(dense_decode_attention(q, k8.float(), v8.float(), case.scale), exact)
    vs_fp32 = relative_error(exact, dense_decode_attention(q, case.keys, case.values, case.scale))
    top = []
    for keys in (k16, k8):
        logits = torch.einsum("hd,nhd->nh", q.view(KV_HEADS, -1, DIM).mean(1), keys.float())
        per_block = logits.amax(1).view(-1, BLOCK_TOKENS).amax(1)
        top.append(set(torch.topk(per_block, len(case.needle_blocks)).indices.tolist()))
    return err, vs_fp32, max(kw, vw), top[0] == top[1] == set(case.needle_blocks.tolist())


def accuracy_rows(tokens_list: list[int]) -> list[str]:
    rows = []
    for tokens in tokens_list:
        err, vs_fp32, worst, kept = attention_error(tokens)
        kept_word = "yes" if kept else "no"
        rows.append(f"| {tokens // 1024}k tokens | {err:.4f} | {vs_fp32:.4f} | {worst:.3f} | {kept_word} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, 32)
    p.add_argument("--tokens", type=int, nargs="*", default=[8192, 32768])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tier, capacity = asyncio.run(tier_rows(args.blocks, args.block_size, args.repeats))
    speed = codec_rates(args.block_size, args.repeats * 4)
    accuracy = accuracy_rows(args.tokens)
    lines = [
        "# Compression at rest: capacity, speed, accuracy (fp8 e4m3)",
        "",
        f"`python -m benchmarks.codec_bench`: {args.block_size >> 20} MiB KV-like blocks, best of "
        f"{args.repeats} (codec alone: of {4 * args.repeats}), Posix without fsync (page cache), "
        "2 shared CPUs.",
        "",
        "| stored | raw bytes | encoded bytes | capacity gain |",
        "|---|---|---|---|",
        *capacity,
        "",
        "| path | encode or dump GB/s | decode or load GB/s |",
        "|---|---|---|",
        *speed,
        *tier,
        "",
        "Dense decode attention on the sparse benchmark's planted-needle data (32 heads, 8 KV heads, dim "
        "128), K and V in bf16 vs through the codec (128-token blocks): *rel. err* = "
        "‖out_codec − out_bf16‖ / ‖out_bf16‖; *bf16 vs fp32* for scale; *worst/bound*: the largest "
        "per-element error over the documented bound (≤ 1 holds it); *needles kept*: the needle blocks "
        "stay the most-attended, with and without the codec.",
        "",
        "| context | rel. err (codec) | bf16 vs fp32 | worst/bound | needles kept |",
        "|---|---|---|---|---|",
        *accuracy,
    ]
    publish("codec", "\n".join(lines) + "\n", write=not args.no_write)


if __name__ == "__main__":
    main()
