"""The Cache's bookkeeping of a batch in one call leaves its indexes as a call per key would.

An eviction policy told of a batch's stores and reads at once (``inserted_many``, ``touched_many``),
keys repeated in the batch and, for reads, keys the policy never held included; the size index given
a batch of one namespace (cut into digests as an array) or of several (key by key)."""

from __future__ import annotations

import os

import pytest

from ucm_protocol.keys import BlockKey, make_keys
from ucm_server.store.base import ARRAY_KEYS, SizeIndex
from ucm_server.store.policy import POLICIES, make_policy


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_batched_calls_leave_the_order_of_single_calls(name: str) -> None:
    keys = [bytes([i]) * 48 for i in range(40)]
    stored = keys[:30] + keys[5:10]  # five stored twice
    sizes = [100 + i for i in range(len(stored))]
    read = keys[20:25] + keys[35:] + keys[3:6]  # five never stored
    one, many = make_policy(name, 1 << 20), make_policy(name, 1 << 20)
    for key, size in zip(stored, sizes, strict=True):
        one.inserted(key, size)
    many.inserted_many(stored, sizes)
    assert list(many.order()) == list(one.order()) and len(many) == len(one)
    for key in read:
        one.touched(key)
    many.touched_many(read)
    assert list(many.order()) == list(one.order())
    many.touched_many(keys[:30])  # every key held: the one-pass path
    for key in keys[:30]:
        one.touched(key)
    assert list(many.order()) == list(one.order())
    with pytest.raises(ValueError):
        many.inserted_many(keys[30:], [1])


def test_the_size_index_holds_a_batch_as_it_holds_its_keys_one_by_one() -> None:
    ns = os.urandom(16)
    digests = [os.urandom(31) + b"\x00" for _ in range(ARRAY_KEYS)] + [bytes(32), b"\x00" * 31 + b"\x01"]
    keys = make_keys(ns, digests)
    sizes = list(range(1, len(keys) + 1))
    batch, single = SizeIndex(), SizeIndex()
    batch.add_many(keys, sizes)
    for key, size in zip(keys, sizes, strict=True):
        single.add_many([key], [size])
    assert batch.lookup(keys) == single.lookup(keys) == sizes
    assert batch.lookup_digests(ns, digests) == sizes  # digests with trailing zero bytes kept whole
    assert sorted(batch.keys()) == sorted(keys)
    other = BlockKey(os.urandom(16), digests[0])  # two namespaces in one batch: key by key
    mixed = SizeIndex()
    mixed.add_many([*keys, other], [*sizes, 7])
    assert mixed.lookup([*keys, other]) == [*sizes, 7]
    with pytest.raises(ValueError):
        SizeIndex().add_many(keys, sizes[:-1])
