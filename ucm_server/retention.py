"""Retention rules: which blocks are pinned, when they expire, and in what order they are evicted.

One table for the whole daemon, not one per tier, so a rule holds wherever the block is: the Cache
and Posix tiers ask it for their eviction order (:meth:`RetentionTable.victims`: pinned blocks are
never offered, lower priority goes first, least recently used first within a priority), the tenant
ledger skips pinned blocks when it evicts over a quota, and the engine's sweeper deletes expired
blocks from every tier. A block without a rule costs nothing here (most blocks have none).

Rules survive a restart: ``<data_dir>/retention.json`` is a journal, one JSON document per line (a
snapshot ``{"version": 1, "rules": {...}}`` first, then one ``{"set": {...}, "drop": [...]}`` line per
change, appended and fsynced in a worker thread before the change is answered). Start-up replays it and
rewrites it as one snapshot of the rules still worth keeping (temp file, fsync, rename). A torn last
line (a crash mid-append) is skipped; any other damage stops start-up with the file and line named.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ucm_protocol.errors import ConfigError, InvalidArgument, ResourceExhausted
from ucm_protocol.keys import NAMESPACE_BYTES, BlockKey
from ucm_protocol.wire import PRIORITY_MAX, PRIORITY_MIN
from ucm_server.journal import JournalFile, read_regular

V = TypeVar("V")

MAX_TTL_S = 10 * 365 * 86400.0
MAX_RULES = 1_000_000
"""Rules the table holds at most (about 150 B each): a client cannot grow the daemon without bound."""
FILE_NAME = "retention.json"
_VERSION = 1
_KEY_HEX = 2 * (NAMESPACE_BYTES + 32)
_MAX_FILE_BYTES = 1 << 30
_FIX = (
    "fix the file or move it aside (blocks stay stored; their pins, expiries and priorities are then "
    "forgotten)"
)
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rule:
    """One block's retention: pinned (never evicted), expiry (Unix seconds, 0 = never), priority."""

    pinned: bool = False
    expires_at: float = 0.0
    priority: int = 0

    @property
    def plain(self) -> bool:
        """The rule every block has by default (nothing to remember)."""
        return not self.pinned and not self.expires_at and not self.priority


PLAIN = Rule()


@dataclass(frozen=True, slots=True)
class Change:
    """What a request changes; ``None`` leaves that part as it is."""

    pin: bool | None = None
    ttl_s: float | None = None
    """Seconds from now until expiry; 0 clears the expiry."""
    priority: int | None = None

    def __post_init__(self) -> None:
        if self.ttl_s is not None and (not math.isfinite(self.ttl_s) or not 0 <= self.ttl_s <= MAX_TTL_S):
            raise InvalidArgument(f"ttl_s must be between 0 and {MAX_TTL_S:.0f} seconds, got {self.ttl_s}")
        if self.priority is not None and not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise InvalidArgument(
                f"priority must be between {PRIORITY_MIN} and {PRIORITY_MAX}, got {self.priority}"
            )
        if self.pin is None and self.ttl_s is None and self.priority is None:
            raise InvalidArgument("nothing to change: give a pin, unpin, ttl or priority")

    def apply(self, rule: Rule, now: float) -> Rule:
        return Rule(
            pinned=rule.pinned if self.pin is None else self.pin,
            expires_at=rule.expires_at if self.ttl_s is None else (now + self.ttl_s if self.ttl_s else 0.0),
            priority=rule.priority if self.priority is None else self.priority,
        )


class RetentionTable:
    """The rules by key, the expiry heap, and the journal file (``path``; ``None``: not persisted)."""

    def __init__(self, path: Path | None, executor: Executor | None = None) -> None:
        self.path = path
        self._executor = executor
        self._rules: dict[bytes, Rule] = {}
        self._pinned: set[bytes] = set()
        self._expiry: list[tuple[float, bytes]] = []  # (expires_at, key); stale entries skipped
        self._file = JournalFile(path) if path is not None else None
        if path is not None:
            for key, rule in read_journal(path).items():
                self._put(key, rule)

    # -- questions (event loop; cheap) -----------------------------------------------------------------
    def get(self, key: bytes) -> Rule:
        return self._rules.get(key, PLAIN)

    def __len__(self) -> int:
        return len(self._rules)

    def pinned(self, key: bytes) -> bool:
        return key in self._pinned

    @property
    def pinned_count(self) -> int:
        return len(self._pinned)

    def pinned_keys(self) -> frozenset[bytes]:
        return frozenset(self._pinned)

    def keys(self) -> list[BlockKey]:
        return [_as_key(k) for k in self._rules]

    def due(self, now: float) -> bool:
        """Whether some rule has expired (the heap's first entry, possibly stale: then a sweep finds none)."""
        return bool(self._expiry) and self._expiry[0][0] <= now

    def expired(self, now: float) -> list[BlockKey]:
        """Keys whose expiry has passed (their rules stay until :meth:`forget`)."""
        out: list[BlockKey] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            at, key = heapq.heappop(heap)
            rule = self._rules.get(key)
            if rule is not None and rule.expires_at == at:
                out.append(_as_key(key))
        return out

    def requeue(self, keys: Iterable[bytes]) -> None:
        """Put expired keys back on the heap (their deletion failed: the next sweep retries)."""
        for key in keys:
            rule = self._rules.get(bytes(key))
            if rule is not None and rule.expires_at:
                heapq.heappush(self._expiry, (rule.expires_at, bytes(key)))

    def victims(
        self, candidates: Iterable[tuple[bytes, V]], find: Callable[[bytes], V | None]
    ) -> Iterator[tuple[bytes, V]]:
        """A tier's eviction order under these rules. ``candidates``: the tier's own order (least
        recently used first); ``find``: the tier's value for a key, ``None`` when it does not hold it.

        Negative priorities come first (lowest first), then the tier's order for blocks of priority
        0, then positive priorities (lowest first); pinned blocks never. Costs the rules with a
        priority (sorted) plus the candidates walked: a caller stops iterating once it has room."""
        low: list[tuple[int, bytes]] = []
        high: list[tuple[int, bytes]] = []
        for key, rule in self._rules.items():
            if rule.priority and not rule.pinned:
                (low if rule.priority < 0 else high).append((rule.priority, key))
        for _, key in sorted(low):
            value = find(key)
            if value is not None:
                yield key, value
        rules = self._rules
        for key, value in candidates:
            found = rules.get(key)
            if found is None or (not found.pinned and not found.priority):
                yield key, value
        for _, key in sorted(high):
            value = find(key)
            if value is not None:
                yield key, value

    # -- changes -----------------------------------------------------------------------------------------
    async def change(self, keys: Iterable[BlockKey], change: Change, now: float) -> list[Rule]:
        """Apply ``change`` to ``keys`` durably (journal appended and fsynced off the loop) before the
        rules take effect; returns the new rules in ``keys`` order."""
        keys = list(keys)
        new = [change.apply(self.get(k), now) for k in keys]
        grows = sum(1 for k, r in zip(keys, new, strict=True) if k not in self._rules and not r.plain)
        if len(self._rules) + grows > MAX_RULES:
            raise ResourceExhausted(
                f"the daemon holds {len(self._rules)} retention rules; {grows} more would pass the limit "
                f"{MAX_RULES}: unpin or let some expire first"
            )
        await self._journal({k: r for k, r in zip(keys, new, strict=True)})
        for k, r in zip(keys, new, strict=True):
            self._put(k, r)
        return new

    async def forget(self, keys: Iterable[bytes]) -> None:
        """Drop the rules of blocks that are gone (deleted, expired, evicted everywhere)."""
        gone = [k for k in keys if k in self._rules]
        if not gone:
            return
        await self._journal(dict.fromkeys(gone, PLAIN))
        for k in gone:
            self._put(k, PLAIN)

    async def compact(self, keep: Callable[[bytes, Rule], bool] | None = None) -> None:
        """Rewrite the journal as one snapshot (only the rules ``keep`` accepts, when given)."""
        if keep is not None:
            for key, rule in list(self._rules.items()):
                if not keep(key, rule):
                    self._put(key, PLAIN)
        if self._file is None:
            return
        data = (json.dumps({"version": _VERSION, "rules": _line(self._rules)["set"]}) + "\n").encode()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._file.rewrite, data)

    def _put(self, key: bytes, rule: Rule) -> None:
        key = bytes(key)
        if rule.plain:
            self._rules.pop(key, None)
            self._pinned.discard(key)
            return
        self._rules[key] = rule
        if rule.pinned:
            self._pinned.add(key)
        else:
            self._pinned.discard(key)
        if rule.expires_at:
            heapq.heappush(self._expiry, (rule.expires_at, key))

    # -- the file ----------------------------------------------------------------------------------------
    async def _journal(self, rules: dict[BlockKey, Rule] | dict[bytes, Rule]) -> None:
        if self._file is None:
            return
        line = (json.dumps(_line(rules)) + "\n").encode()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._file.append, line)


def _line(rules: dict[BlockKey, Rule] | dict[bytes, Rule]) -> dict[str, object]:
    """A journal line: rules to set (``[pinned, expires_at, priority]`` by key hex), keys to drop."""
    put = {bytes(k).hex(): [r.pinned, r.expires_at, r.priority] for k, r in rules.items() if not r.plain}
    drop = [bytes(k).hex() for k, r in rules.items() if r.plain]
    return {"set": put, "drop": drop}


def read_journal(path: Path) -> dict[bytes, Rule]:
    """The rules in ``path`` ({} when there is none); :class:`ConfigError` naming file and line for
    any damage but a torn last line (no newline after it: an append cut by a crash, never answered)."""
    what = f"retention rules {path}"
    data = read_regular(path, what, _FIX, _MAX_FILE_BYTES)
    if data is None:
        return {}
    rules: dict[bytes, Rule] = {}
    lines = data.split(b"\n")
    tail = lines.pop()  # what follows the last newline: b"" in a complete file
    if tail:
        log.warning("%s: skipping a torn last line (%d bytes, an append cut by a crash)", what, len(tail))
    for number, raw in enumerate(lines, start=1):
        try:
            doc = json.loads(raw)
            snapshot = number == 1 and isinstance(doc, dict) and "rules" in doc
            put = doc["rules"] if snapshot else doc["set"]
            drop = [] if snapshot else doc["drop"]
            for hexkey, (pinned, expires_at, priority) in put.items():
                rules[_parse_key(hexkey)] = _rule(pinned, expires_at, priority)
            for hexkey in drop:
                rules.pop(_parse_key(hexkey), None)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{what}, line {number}: {exc}; {_FIX}") from None
    return rules


def _parse_key(text: object) -> bytes:
    if not isinstance(text, str) or len(text) != _KEY_HEX:
        raise ValueError(f"a key must be {_KEY_HEX} hex digits")
    return bytes.fromhex(text)


def _rule(pinned: object, expires_at: object, priority: object) -> Rule:
    if (
        not isinstance(pinned, bool)
        or not isinstance(expires_at, int | float)
        or not isinstance(priority, int)
        or isinstance(priority, bool)
    ):
        raise ValueError("a rule is [pinned (bool), expires_at (number), priority (int)]")
    if not math.isfinite(expires_at) or expires_at < 0 or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError("a rule's expiry or priority is out of range")
    return Rule(pinned, float(expires_at), priority)


def _as_key(key: bytes) -> BlockKey:
    return key if isinstance(key, BlockKey) else BlockKey(key[:NAMESPACE_BYTES], key[NAMESPACE_BYTES:])
