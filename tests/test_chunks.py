"""The one chunking rule of the host and GPU data paths (chunking exists once).

Both paths cut a task into the ranges :func:`ucm_server.chunks.chunk_bounds` returns; the rule is
checked here on its own, so a change to it shows here first, not as a cancel that comes late.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ucm_server.chunks import CHUNK_BLOCKS, CHUNK_BYTES, chunk_bounds

SIZES = st.lists(
    st.one_of(st.sampled_from([0, 1, 4096, 1 << 20, CHUNK_BYTES - 1, CHUNK_BYTES]), st.integers(0, 3 << 20)),
    max_size=700,
)


@given(SIZES)
def test_chunks_cover_the_batch_in_order_within_the_limits(sizes: list[int]) -> None:
    bounds = chunk_bounds(iter(sizes))  # any iterable: the host path passes a generator
    assert [i for a, b in bounds for i in range(a, b)] == list(range(len(sizes)))
    for n, (a, b) in enumerate(bounds):
        assert 0 < b - a <= CHUNK_BLOCKS
        last = n == len(bounds) - 1
        full = b - a == CHUNK_BLOCKS or sum(sizes[a:b]) >= CHUNK_BYTES
        assert full or last  # only the last chunk may end short of a limit
        assert sum(sizes[a : b - 1]) < CHUNK_BYTES  # a chunk ends at the block that reaches the limit


def test_known_cuts() -> None:
    assert chunk_bounds([]) == []
    assert chunk_bounds([1] * (CHUNK_BLOCKS + 1)) == [(0, CHUNK_BLOCKS), (CHUNK_BLOCKS, CHUNK_BLOCKS + 1)]
    assert chunk_bounds([CHUNK_BYTES, 1, 1]) == [(0, 1), (1, 3)]
    assert chunk_bounds([CHUNK_BYTES // 2] * 3) == [(0, 2), (2, 3)]


@given(
    st.one_of(
        st.sampled_from([0, 1, 4096, 64 << 10, 1 << 20, CHUNK_BYTES // 3, CHUNK_BYTES]),
        st.integers(0, 3 << 20),
    ),
    st.integers(0, 3 * CHUNK_BLOCKS + 1),
)
def test_blocks_of_one_size_are_cut_as_the_walk_cuts_them(size: int, n: int) -> None:
    """A list of equal sizes takes the arithmetic cut; it must be the walk's, block for block."""
    assert chunk_bounds([size] * n) == chunk_bounds(iter([size] * n))
