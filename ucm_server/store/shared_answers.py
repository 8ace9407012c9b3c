"""What shared tiers answered recently, so a lookup asks a remote store once per short while.

vLLM's scheduler asks about the same prefix again and again, and a shared tier's lookup (a store other
nodes change: Mooncake, S3, DS3FS) costs milliseconds to seconds. Its answers, positive and negative,
are reused for ``ttl_s`` seconds (0: never); this daemon's own writes and deletes forget the answers
about their keys at once, so only other nodes' changes can be seen late.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from ucm_protocol.keys import BlockKey
from ucm_server.store.base import Tier

__all__ = ["SharedAnswers"]

PRUNE_ABOVE = 200_000
"""Answers kept before the expired ones are dropped."""


class SharedAnswers:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._seen: dict[tuple[str, BlockKey], tuple[int | None, float]] = {}

    async def lookup(self, tier: Tier, keys: list[BlockKey]) -> list[int | None]:
        """``tier.lookup(keys)``, asking the tier only about the keys with no fresh answer."""
        now = time.monotonic()
        seen = self._seen
        out: list[int | None] = [None] * len(keys)
        ask: list[int] = []
        for i, key in enumerate(keys):
            hit = seen.get((tier.name, key))
            if hit is not None and hit[1] > now:
                out[i] = hit[0]
            else:
                ask.append(i)
        if ask:
            found = await tier.lookup([keys[i] for i in ask])
            until = time.monotonic() + self.ttl_s
            if len(seen) > PRUNE_ABOVE:
                self._seen = seen = {k: v for k, v in seen.items() if v[1] > now}
            for i, size in zip(ask, found, strict=True):
                out[i] = size
                if self.ttl_s > 0:
                    seen[(tier.name, keys[i])] = (size, until)
        return out

    def forget(self, keys: Iterable[BlockKey], tiers: Sequence[Tier]) -> None:
        """Our own write or delete of ``keys``: the answers about them are stale."""
        if not self._seen:
            return
        shared = [t.name for t in tiers if t.shared]
        for k in keys:
            for name in shared:
                self._seen.pop((name, k), None)
