"""A batch told to an eviction policy at once leaves it as the same calls one key at a time would:
the Cache tells its policy of a batch's stores and reads in one call each (``inserted_many``,
``touched_many``), including keys repeated in the batch and, for reads, keys the policy never held."""

from __future__ import annotations

import pytest

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
