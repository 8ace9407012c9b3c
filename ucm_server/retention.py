"""Retention rules: which blocks are pinned, when they expire, and in what order they are evicted.

One table for the whole daemon, not one per tier, so a rule holds wherever the block is: the Cache
and Posix tiers ask it for their eviction order (:meth:`RetentionTable.victims`: pinned blocks are
never offered, lower priority goes first, least recently used first within a priority), the tenant
ledger skips pinned blocks when it evicts over a quota, and the engine's sweeper deletes expired
blocks from every tier. A block without a rule costs nothing here (most blocks have none).

Rules survive a restart: ``<data_dir>/retention.json`` is a journal, one JSON document per line (a
snapshot ``{"version": 1, "rules": {...}}`` first, then ``{"set": {...}, "drop": [...]}`` lines, each
of at most :data:`LINE_RULES` rules, appended and fsynced in a worker thread before a change is
answered). What is kept, on disk and in memory, is proportional to the rules in force, never to the
changes made: a change that changes nothing writes nothing; once the lines appended since the last
snapshot outweigh it (and :data:`COMPACT_MIN_BYTES`), the file is rewritten as one snapshot (temp
file, fsync, rename), so it stays under about twice the snapshot; the expiry heap is rebuilt when
stale entries outnumber live ones. At most ``max_retention_rules`` rules are held
(``RESOURCE_EXHAUSTED`` naming the setting beyond). Start-up reads the file line by line and rewrites
it as one snapshot; a torn last line (a crash mid-append) is skipped; any other damage stops start-up
with the file and line named. Nothing the daemon writes is refused when read back: no size cap on the
file, and a file holding more rules than the setting allows now (it was lowered) is loaded whole,
new rules refused until enough are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
import math
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from ucm_protocol.errors import ConfigError, InvalidArgument, ResourceExhausted
from ucm_protocol.keys import NAMESPACE_BYTES, BlockKey
from ucm_protocol.wire import PRIORITY_MAX, PRIORITY_MIN
from ucm_server.journal import JournalFile

V = TypeVar("V")

MAX_TTL_S = 10 * 365 * 86400.0
MAX_RULES = 1_000_000
"""Default of ``max_retention_rules``: rules the table holds at most (about 150 B each on disk, a few
hundred in memory), so no client can grow the daemon without bound."""
FILE_NAME = "retention.json"
LINE_RULES = 4096
"""Rules per journal line at most (snapshot and changes alike): a line costs bounded memory to read."""
COMPACT_MIN_BYTES = 1 << 20
"""Appended bytes below which the journal is never compacted (the snapshot's size above it)."""
HEAP_SLACK = 1024
"""Stale expiry-heap entries tolerated beyond the live ones before the heap is rebuilt."""
_VERSION = 1
_KEY_HEX = 2 * (NAMESPACE_BYTES + 32)
_MAX_LINE_BYTES = 1 << 30
"""Longer than any line the daemon writes, or ever wrote (an older release wrote its snapshot as one
line, in a file of at most 1 GiB)."""
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

    def __init__(
        self, path: Path | None, executor: Executor | None = None, *, max_rules: int = MAX_RULES
    ) -> None:
        self.path = path
        self.max_rules = max_rules
        self._executor = executor
        self._rules: dict[bytes, Rule] = {}
        self._pinned: set[bytes] = set()
        self._expiry: list[tuple[float, bytes]] = []  # (expires_at, key); stale entries skipped
        self._expiring = 0
        """Rules with an expiry: the heap's live entries (at most; popped ones may be pending)."""
        self._file = JournalFile(path) if path is not None else None
        self._appended = 0
        """Bytes appended to the journal since its last snapshot."""
        self._snapshot_bytes = 0
        self._writing = asyncio.Lock()
        """Held across a journal write and the change it records, and across a compaction: a snapshot
        never misses a change whose line it replaces."""
        if path is not None:
            for key, rule in read_journal(path).items():
                self._put(key, rule)
            if len(self._rules) > max_rules:
                log.warning(
                    "retention rules %s: %d rules, more than max_retention_rules (%d): all kept, new "
                    "rules refused until enough are unpinned or expire",
                    path,
                    len(self._rules),
                    max_rules,
                )
            if path.exists():  # one snapshot from the start: no torn tail an append could extend
                data = _snapshot(dict(self._rules))
                assert self._file is not None
                self._file.rewrite(data)
                self._snapshot_bytes = len(data)

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

    @property
    def heap_entries(self) -> int:
        """Entries on the expiry heap, stale ones included (bounded by the rules with an expiry)."""
        return len(self._expiry)

    @property
    def journal_bytes(self) -> int:
        """The journal's size as this table wrote it: the last snapshot and the lines since."""
        return self._snapshot_bytes + self._appended

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
        rules take effect; returns the new rules in ``keys`` order. Only rules that differ from the
        ones in force are written (a repeated pin writes nothing)."""
        keys = list(keys)
        new = [change.apply(self.get(k), now) for k in keys]
        differ = {bytes(k): r for k, r in zip(keys, new, strict=True) if self.get(k) != r}
        grows = sum(1 for k, r in differ.items() if k not in self._rules and not r.plain)
        if grows and len(self._rules) + grows > self.max_rules:
            raise ResourceExhausted(
                f"the daemon holds {len(self._rules)} retention rules; {grows} more would pass the limit "
                f"{self.max_rules} (setting max_retention_rules): unpin or let some expire first"
            )
        await self._commit(differ)
        return new

    async def forget(self, keys: Iterable[bytes]) -> None:
        """Drop the rules of blocks that are gone (deleted, expired, evicted everywhere)."""
        await self._commit({bytes(k): PLAIN for k in keys if k in self._rules})

    async def compact(self, keep: Callable[[bytes, Rule], bool] | None = None) -> None:
        """Rewrite the journal as one snapshot (only the rules ``keep`` accepts, when given)."""
        async with self._writing:
            if keep is not None:
                for key, rule in list(self._rules.items()):
                    if not keep(key, rule):
                        self._put(key, PLAIN)
            await self._write_snapshot()

    async def _commit(self, rules: dict[bytes, Rule]) -> None:
        """Journal ``rules`` (when persisted), then put them in force; compact when due."""
        if not rules:
            return
        async with self._writing:
            if self._file is not None:
                data = _change_lines(rules)
                await asyncio.get_running_loop().run_in_executor(self._executor, self._file.append, data)
                self._appended += len(data)
            for key, rule in rules.items():
                self._put(key, rule)
            if self._appended > max(self._snapshot_bytes, COMPACT_MIN_BYTES):
                await self._write_snapshot()

    async def _write_snapshot(self) -> None:
        """The journal as one snapshot of the rules in force (caller holds ``_writing``)."""
        if self._file is None:
            return
        rules = dict(self._rules)  # a copy: serialised in a worker thread while the loop goes on
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(self._executor, _snapshot, rules)
        await loop.run_in_executor(self._executor, self._file.rewrite, data)
        self._snapshot_bytes, self._appended = len(data), 0

    def _put(self, key: bytes, rule: Rule) -> None:
        key = bytes(key)
        old = self._rules.get(key)
        if old is not None and old.expires_at:
            self._expiring -= 1
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
            self._expiring += 1
            if old is None or old.expires_at != rule.expires_at:
                heapq.heappush(self._expiry, (rule.expires_at, key))
                if len(self._expiry) > 2 * self._expiring + HEAP_SLACK:
                    self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """The heap of the live expiries only (stale entries of changed or dropped rules gone)."""
        self._expiry = [(r.expires_at, k) for k, r in self._rules.items() if r.expires_at]
        heapq.heapify(self._expiry)


def _line(rules: dict[BlockKey, Rule] | dict[bytes, Rule]) -> dict[str, object]:
    """A journal line: rules to set (``[pinned, expires_at, priority]`` by key hex), keys to drop."""
    put = {bytes(k).hex(): [r.pinned, r.expires_at, r.priority] for k, r in rules.items() if not r.plain}
    drop = [bytes(k).hex() for k, r in rules.items() if r.plain]
    return {"set": put, "drop": drop}


def _chunks(rules: dict[bytes, Rule]) -> Iterator[dict[bytes, Rule]]:
    items = list(rules.items())
    for start in range(0, len(items), LINE_RULES):
        yield dict(items[start : start + LINE_RULES])


def _change_lines(rules: dict[bytes, Rule]) -> bytes:
    """``rules`` as journal lines of at most :data:`LINE_RULES` rules each."""
    return b"".join((json.dumps(_line(chunk)) + "\n").encode() for chunk in _chunks(rules))


def _snapshot(rules: dict[bytes, Rule]) -> bytes:
    """The journal of ``rules`` alone: the snapshot line (the first :data:`LINE_RULES` rules), then
    set lines for the rest (any thread)."""
    chunks = list(_chunks(rules)) or [{}]
    head = {"version": _VERSION, "rules": _line(chunks[0])["set"]}
    return (json.dumps(head) + "\n").encode() + b"".join(
        (json.dumps(_line(chunk)) + "\n").encode() for chunk in chunks[1:]
    )


def read_journal(path: Path) -> dict[bytes, Rule]:
    """The rules in ``path`` ({} when there is none), read line by line; :class:`ConfigError` naming
    file and line for any damage but a torn last line (no newline after it: an append cut by a
    crash, never answered)."""
    what = f"retention rules {path}"
    rules: dict[bytes, Rule] = {}
    with _open_regular(path, what) as f:
        if f is None:
            return {}
        number = 0
        while raw := f.readline(_MAX_LINE_BYTES + 1):
            number += 1
            if not raw.endswith(b"\n"):
                if len(raw) > _MAX_LINE_BYTES:
                    raise ConfigError(f"{what}, line {number}: longer than {_MAX_LINE_BYTES} bytes; {_FIX}")
                log.warning(
                    "%s: skipping a torn last line (%d bytes, an append cut by a crash)", what, len(raw)
                )
                break
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


@contextlib.contextmanager
def _open_regular(path: Path, what: str) -> Iterator[BinaryIO | None]:
    """``path`` opened for reading, or None when absent; only a regular file (no FIFO, device or
    symlink: never opened blocking, never followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None
        return
    except OSError as exc:
        raise ConfigError(f"{what}: cannot open it: {exc.strerror}; {_FIX}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{what}: not a regular file; {_FIX}")
        try:
            yield f
        except OSError as exc:
            raise ConfigError(f"{what}: cannot read it: {exc.strerror}; {_FIX}") from None


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
