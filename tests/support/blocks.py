"""Test blocks: a namespace and block lists laid out in one registered region.

Lives outside ``conftest.py`` so that test folders with their own conftest (``tests/vllm``) can be
collected together with those importing these helpers (``tests/gpu``): ``from conftest import``
picks whichever conftest was imported first.
"""

from __future__ import annotations

from ucm_client import BlockIO, Segment, key_digest, namespace_id

NS = namespace_id(model="pytest", dtype="uint8")


def blocks_in(region: int, count: int, size: int, *, first: int = 0, offset: int = 0) -> list[BlockIO]:
    """``count`` consecutive blocks of ``size`` bytes in one region, keyed by their index."""
    return [
        BlockIO(key_digest("block", first + i), (Segment(region, offset + i * size, size),))
        for i in range(count)
    ]
