"""How a task's batch is cut into chunks: the one rule for the host and the GPU data paths.

A chunk is the unit of work between two cancel points (and, on the GPU path, of one queued batch of
device copies): at most :data:`CHUNK_BLOCKS` blocks, and it ends at the block that brings it to
:data:`CHUNK_BYTES` bytes, so a cancel is honoured within one chunk's worth of I/O whatever the
block size.
"""

from __future__ import annotations

from collections.abc import Iterable

CHUNK_BLOCKS = 256
CHUNK_BYTES = 64 << 20


def chunk_bounds(sizes: Iterable[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` index ranges covering a batch whose blocks have ``sizes`` bytes, in order.
    A list of blocks all of one size (the usual batch) is cut by arithmetic, not a step per block."""
    if isinstance(sizes, list) and sizes and sizes[0] > 0 and sizes.count(sizes[0]) == len(sizes):
        per = min(CHUNK_BLOCKS, -(-CHUNK_BYTES // sizes[0]))  # the first count reaching either limit
        return [(start, min(start + per, len(sizes))) for start in range(0, len(sizes), per)]
    out: list[tuple[int, int]] = []
    start = total = count = 0
    for i, size in enumerate(sizes):
        count = i + 1
        total += size
        if count - start >= CHUNK_BLOCKS or total >= CHUNK_BYTES:
            out.append((start, count))
            start, total = count, 0
    if start < count:
        out.append((start, count))
    return out
