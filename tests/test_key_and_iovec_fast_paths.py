"""The per-block fast paths of a Dump/Load's request handling build exactly what the plain code did.

``make_keys`` builds ``BlockKey`` objects through C-level maps, ``iov_len`` and ``host_iovecs``
skip their generic walk for one-segment blocks (issue #13 item 4: per-block Python on the
critical path before a copy starts). Each is compared with the plain construction, on inputs that
take the fast path and on those that do not.
"""

from __future__ import annotations

import os

import pytest

from ucm_protocol.errors import InvalidArgument
from ucm_protocol.keys import BlockKey, make_keys
from ucm_server.regions import host_iovecs
from ucm_server.store.base import iov_len


def test_make_keys_builds_the_same_block_keys_as_the_constructor() -> None:
    ns = os.urandom(16)
    digests = [os.urandom(32), bytes(32), bytearray(b"\x07" * 32), os.urandom(31) + b"\x00"]
    keys = make_keys(ns, digests)
    expected = [BlockKey(ns, bytes(d)) for d in digests]
    assert keys == expected
    assert all(type(k) is BlockKey for k in keys)
    assert [k.namespace for k in keys] == [ns] * len(digests)
    assert [k.digest for k in keys] == [bytes(d) for d in digests]
    assert {k: i for i, k in enumerate(keys)}[ns + bytes(digests[1])] == 1  # plain bytes find them


def test_make_keys_still_names_a_bad_digest_and_namespace() -> None:
    with pytest.raises(InvalidArgument, match=r"keys\[2\] must be 32 bytes, got 33"):
        make_keys(os.urandom(16), [os.urandom(32), os.urandom(32), os.urandom(33)])
    with pytest.raises(InvalidArgument, match="namespace must be 16 bytes"):
        make_keys(os.urandom(15), [os.urandom(32)])


class _Region:
    def __init__(self, size: int) -> None:
        self.view = memoryview(bytearray(os.urandom(size)))


def test_host_iovecs_and_iov_len_one_and_several_segments() -> None:
    a, b = _Region(1 << 16), _Region(1 << 16)
    blocks = [
        [(a, 0, 4096)],  # one segment: the fast path
        [(a, 4096, 100), (b, 10, 5), (a, 9000, 1)],  # several: the generic walk
        [(b, 65535, 1)],
    ]
    iovs = host_iovecs(blocks)
    assert [[bytes(v) for v in iov] for iov in iovs] == [
        [bytes(r.view[o : o + n]) for r, o, n in segs] for segs in blocks
    ]
    assert [iov_len(iov) for iov in iovs] == [4096, 106, 1]
    iovs[0][0][:4] = b"abcd"  # views into the region, not copies
    assert bytes(a.view[:4]) == b"abcd"
    assert iov_len([]) == 0
