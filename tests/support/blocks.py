"""Test blocks: a namespace and block lists laid out in one registered region.

Lives outside ``conftest.py`` so that test folders with their own conftest (``tests/vllm``) can be
collected together with those importing these helpers (``tests/gpu``): ``from conftest import``
picks whichever conftest was imported first.
"""

from __future__ import annotations

import os

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id

NS = namespace_id(model="pytest", dtype="uint8")


def blocks_in(region: int, count: int, size: int, *, first: int = 0, offset: int = 0) -> list[BlockIO]:
    """``count`` consecutive blocks of ``size`` bytes in one region, keyed by their index."""
    return [
        BlockIO(key_digest("block", first + i), (Segment(region, offset + i * size, size),))
        for i in range(count)
    ]


def dump_random(client: UcmClient, first: int, count: int, size: int) -> dict[bytes, bytes]:
    """``count`` blocks of ``size`` random bytes keyed ``first...``, dumped durably (in every tier
    the pipeline writes down to), eight at a time; their keys and bytes, in order."""
    stored: dict[bytes, bytes] = {}
    with SharedBuffer(8 * size) as buf:
        region = client.register(buf)
        for start in range(0, count, 8):
            n = min(8, count - start)
            data = os.urandom(n * size)
            buf.buf[: n * size] = data
            batch = blocks_in(region, n, size, first=first + start)
            result = client.wait(client.dump(NS, batch, wait_durable=True), 30)
            assert result.ok, result
            stored.update((b.key, data[j * size : (j + 1) * size]) for j, b in enumerate(batch))
        client.unregister(region)
    return stored
