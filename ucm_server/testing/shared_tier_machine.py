"""A stateful property test for shared tiers: two nodes' tiers on one engine, one model.

Random writes, reads and deletes go through either node and are checked after every step against a
single in-memory model, so each node must see the other's changes at once. A backend's test file
opens two tiers on its real server and subclasses :class:`SharedTierMachine`, saying only how to give
each example an empty store (``isolate``)::

    class TwoDaemonsOneBucket(SharedTierMachine):
        def isolate(self, tier: Tier, prefix: str) -> None:
            tier.prefix = prefix

Hypothesis builds machines itself, so the open nodes reach them through :data:`NODES` (a fixture
pushes them there for the test's duration).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ucm_protocol.keys import BlockKey, Digest, Namespace
from ucm_protocol.states import BlockState
from ucm_server.store.base import Tier

KEYS = [BlockKey(Namespace(os.urandom(16)), Digest(os.urandom(32))) for _ in range(5)]


class TwoNodes:
    """Two tiers opened once on one event loop (opening a remote tier can cost a second)."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.loop = asyncio.new_event_loop()
        self.tiers = list(tiers)
        for t in self.tiers:
            self.loop.run_until_complete(t.open())

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        for t in self.tiers:
            self.run(t.close())
        self.loop.close()


NODES: list[TwoNodes] = []


class SharedTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.nodes = NODES[-1]
        prefix = f"sm-{uuid.uuid4().hex[:8]}"
        for t in self.nodes.tiers:
            self.isolate(t, prefix)
        self.model: dict[BlockKey, bytes] = {}

    def isolate(self, tier: Tier, prefix: str) -> None:
        """Point ``tier`` at an empty part of the shared store (a fresh key prefix)."""
        raise NotImplementedError

    @rule(n=st.integers(0, 1), k=st.sampled_from(KEYS), data=st.binary(min_size=1, max_size=3000))
    def write(self, n: int, k: BlockKey, data: bytes) -> None:
        (r,) = self.nodes.run(self.nodes.tiers[n].write_many([(k, [memoryview(data)])]))
        assert r.ok, r.reason
        self.model[k] = data

    @rule(n=st.integers(0, 1), k=st.sampled_from(KEYS))
    def read(self, n: int, k: BlockKey) -> None:
        expected = self.model.get(k)
        out = bytearray(len(expected) if expected is not None else 7)
        (r,) = self.nodes.run(self.nodes.tiers[n].read_many([(k, [memoryview(out)])]))
        if expected is None:
            assert r.state is BlockState.MISSING, r
        else:
            assert r.ok, r.reason
            assert bytes(out) == expected

    @rule(n=st.integers(0, 1), k=st.sampled_from(KEYS))
    def delete(self, n: int, k: BlockKey) -> None:
        assert self.nodes.run(self.nodes.tiers[n].delete([k])) == (1 if k in self.model else 0)
        self.model.pop(k, None)

    @invariant()
    def both_nodes_agree_with_the_model(self) -> None:
        want = [len(self.model[k]) if k in self.model else None for k in KEYS]
        for t in self.nodes.tiers:
            assert self.nodes.run(t.lookup(KEYS)) == want
