"""Admission policies: which blocks cross a tier boundary at all, beside the eviction policy that
decides which ones leave (:mod:`ucm_server.store.policy`).

Every block a connector saved used to be admitted to every tier: a one-off long prompt was copied into
the Cache, written to disk and to the shared tier, evicting shared prefixes on its way and wearing the
disks for bytes nobody reads again. A policy sits at each boundary (the daemon's door, the Cache →
local disk write-back, → shared tiers; :mod:`ucm_server.store.admitting` places them) and decides per
block when it is offered there.

A policy is fed *uses* of blocks — an offer (a write reaching its boundary), a Lookup that found the
block, a read — as 64-bit hashes (:func:`key_hashes`: vectorised, no object per key), and answers
offers with a flag per block. A Lookup that misses is not a use: the connector looks a prompt up
before it computes and saves it, so counting the miss would make every one-off look used twice.
Policies keep fixed-size bit and counter arrays, never keys: their memory does not grow with traffic.

Built in (:data:`ADMISSION_POLICIES`; a third-party one is named ``package.module:Class``):

* ``always`` — today's behaviour: everything is admitted.
* ``second-use`` — a block is admitted once it has been used again within the window: a one-off is
  never admitted; a shared prefix is, at its second use (and the block kept above meanwhile is
  written down then, see :mod:`ucm_server.store.admitting`). Two generations of "seen once" and
  "seen twice" Bloom filters, rotated every half window (by time or by keys), remember the uses.
* ``tinylfu`` — TinyLFU (Einziger, Friedman, Manes, ACM ToS 2017): a count-min sketch of 4-bit
  counters behind a one-bit doorkeeper estimates each block's recent frequency (halved every ten
  windows of keys, so the past fades); a block is admitted when there is room for it, or when its
  estimate beats that of the block the tier would evict for it.
"""

from __future__ import annotations

import abc
import importlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from ucm_protocol.errors import ConfigError

Hashes = npt.NDArray[np.uint64]
Flags = npt.NDArray[np.bool_]
NO_VICTIM = np.uint64(0)
"""A candidate's victim hash when the tier has room for it (no block would be evicted)."""

_KEY_WORDS = 6  # a BlockKey is 48 bytes: namespace (16) + digest (32)
_rng = np.random.default_rng()
_MULTIPLIERS = _rng.integers(1, 2**63, size=_KEY_WORDS, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
"""Random odd multipliers, drawn per process: a client cannot pick digests that collide on purpose."""
_PROBES = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93], dtype=np.uint64
)
"""Odd constants deriving independent positions from one hash (multiply-shift hashing)."""


def key_hashes(keys: Sequence[bytes]) -> Hashes:
    """One 64-bit hash per 48-byte block key (never 0, which means "no victim")."""
    if not keys:
        return np.zeros(0, dtype=np.uint64)
    words = np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), _KEY_WORDS)
    return _mix(words @ _MULTIPLIERS)  # integer products and sums wrap: arithmetic modulo 2**64


def digest_hashes(namespace: bytes, digests: Sequence[bytes] | bytes) -> Hashes:
    """:func:`key_hashes` of ``namespace + digest`` for each digest (or packed digests), without
    building the keys."""
    packed = digests if isinstance(digests, bytes) else b"".join(digests)
    if not packed:
        return np.zeros(0, dtype=np.uint64)
    ns = np.frombuffer(namespace, dtype="<u8")
    words = np.frombuffer(packed, dtype="<u8").reshape(-1, _KEY_WORDS - len(ns))
    base = np.atleast_1d(ns @ _MULTIPLIERS[: len(ns)])  # an array: scalar overflow would warn
    return _mix(words @ _MULTIPLIERS[len(ns) :] + base)


def _mix(h: Hashes) -> Hashes:
    """A 64-bit finaliser (MurmurHash3's), so nearby sums land far apart; 0 is moved to 1."""
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xC4CEB9FE1A85EC53)
    h = h ^ (h >> np.uint64(33))
    h[h == 0] = 1
    return h


def _positions(h: Hashes, probe: int, bits: int) -> npt.NDArray[np.uint64]:
    """Position ``probe`` of each hash in a table of ``2 ** bits`` slots."""
    pos: npt.NDArray[np.uint64] = (h * _PROBES[probe]) >> np.uint64(64 - bits)
    return pos


class BloomFilter:
    """A set of hashes in ``2 ** bits`` one-byte slots with ``probes`` positions each (no removal;
    a byte per slot: setting many at once is one exact vector store, where packed bits need a slow
    unbuffered ``bitwise_or.at``)."""

    __slots__ = ("bits", "probes", "table")

    def __init__(self, bits: int, probes: int = 3) -> None:
        self.bits, self.probes = bits, probes
        self.table = np.zeros(1 << bits, dtype=np.bool_)

    def __contains__(self, h: object) -> bool:  # one hash, for tests and readers
        return bool(self.contains(np.array([h], dtype=np.uint64))[0])

    def contains(self, h: Hashes) -> Flags:
        out = self.table[_positions(h, 0, self.bits)]
        for p in range(1, self.probes):
            out &= self.table[_positions(h, p, self.bits)]
        return out

    def add(self, h: Hashes) -> None:
        for p in range(self.probes):
            self.table[_positions(h, p, self.bits)] = True

    def clear(self) -> None:
        self.table.fill(False)


class CountMinSketch:
    """Frequencies of hashes in ``rows`` rows of ``2 ** bits`` counters of 4 bits (kept in bytes,
    saturating at 15, as TinyLFU's); :meth:`halve` ages every counter."""

    __slots__ = ("bits", "table")

    def __init__(self, bits: int, rows: int = len(_PROBES)) -> None:
        self.bits = bits
        self.table = np.zeros((rows, 1 << bits), dtype=np.uint8)

    def add(self, h: Hashes) -> None:
        for r in range(len(self.table)):
            row, pos = self.table[r], _positions(h, r, self.bits)
            row[pos] = np.minimum(row[pos] + 1, 15)  # a key twice in one batch counts once

    def estimate(self, h: Hashes) -> npt.NDArray[np.uint8]:
        est = np.full(len(h), 15, dtype=np.uint8)
        for r in range(len(self.table)):
            est = np.minimum(est, self.table[r][_positions(h, r, self.bits)])
        return est

    def halve(self) -> None:
        self.table >>= 1


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """What every policy is built from (the daemon's ``admission_window_s``/``admission_window_keys``)."""

    window_s: float = 3600.0
    """How long a use is remembered (``second-use``: a block used again later is a new first use)."""
    window_keys: int = 1 << 20
    """How many distinct blocks a window holds before it rotates early; sizes the filters and the
    sketch (about 16 bytes per key for ``second-use``, 12 for ``tinylfu``)."""


def _table_bits(keys: int, per_key: int) -> int:
    return max(10, int(np.ceil(np.log2(max(keys, 1) * per_key))))


class AdmissionPolicy(abc.ABC):
    """Fed uses, answers offers. ``victims`` are the hashes of the blocks the tier would evict to
    make room for each candidate (:data:`NO_VICTIM` where it has room); only frequency-based
    policies look at them."""

    name: str = ""
    needs_victims: bool = False
    """Whether :meth:`admit` reads ``victims`` (the caller skips finding them otherwise)."""

    def __init__(self, settings: AdmissionSettings) -> None:  # noqa: B027 - optional hook
        """``settings``: the window every built-in policy is sized by."""

    @abc.abstractmethod
    def record(self, h: Hashes) -> None:
        """These blocks were used (an offer, a Lookup hit, a read)."""

    @abc.abstractmethod
    def admit(self, h: Hashes, victims: Hashes) -> Flags:
        """Whether each block is admitted now (its uses already recorded)."""


class AlwaysAdmit(AdmissionPolicy):
    """Every block is admitted (what the daemon did before admission policies)."""

    name = "always"

    def record(self, h: Hashes) -> None:
        pass

    def admit(self, h: Hashes, victims: Hashes) -> Flags:
        return np.ones(len(h), dtype=bool)


class SecondUse(AdmissionPolicy):
    """Admitted once used twice within the window (see the module)."""

    name = "second-use"

    def __init__(self, settings: AdmissionSettings) -> None:
        super().__init__(settings)
        self.half_window_s = settings.window_s / 2
        self.half_window_keys = max(settings.window_keys // 2, 1)
        bits = _table_bits(self.half_window_keys, 8)  # 8 bits per key, 3 probes: ~3% false positives
        self._once = [BloomFilter(bits), BloomFilter(bits)]  # current, previous generation
        self._twice = [BloomFilter(bits), BloomFilter(bits)]
        self._recorded = 0
        self._since = time.monotonic()

    def record(self, h: Hashes) -> None:
        self._maybe_rotate(len(h))
        again = self._seen(self._once, h)
        self._twice[0].add(h[again])
        self._once[0].add(h)
        self._recorded += len(h)

    def admit(self, h: Hashes, victims: Hashes) -> Flags:
        return self._seen(self._twice, h)

    @staticmethod
    def _seen(gens: list[BloomFilter], h: Hashes) -> Flags:
        return gens[0].contains(h) | gens[1].contains(h)

    def _maybe_rotate(self, adding: int) -> None:
        now = time.monotonic()
        if now - self._since < self.half_window_s and self._recorded + adding <= self.half_window_keys:
            return
        for gens in (self._once, self._twice):
            gens[0], gens[1] = gens[1], gens[0]
            gens[0].clear()
        self._recorded, self._since = 0, now


class TinyLFU(AdmissionPolicy):
    """Admitted when there is room, or when the estimated frequency beats the victim's."""

    name = "tinylfu"
    needs_victims = True

    def __init__(self, settings: AdmissionSettings) -> None:
        super().__init__(settings)
        keys = max(settings.window_keys, 1)
        self.sketch = CountMinSketch(_table_bits(keys, 1))
        self.doorkeeper = BloomFilter(_table_bits(keys, 8))
        self.sample = 10 * keys
        self._recorded = 0

    def record(self, h: Hashes) -> None:
        known = self.doorkeeper.contains(h)
        self.sketch.add(h[known])
        self.doorkeeper.add(h[~known])
        self._recorded += len(h)
        if self._recorded >= self.sample:  # the reset: the past counts half, one-time uses are forgotten
            self.sketch.halve()
            self.doorkeeper.clear()
            self._recorded //= 2

    def frequency(self, h: Hashes) -> npt.NDArray[np.int16]:
        return self.sketch.estimate(h).astype(np.int16) + self.doorkeeper.contains(h)

    def admit(self, h: Hashes, victims: Hashes) -> Flags:
        room: Flags = np.equal(victims, NO_VICTIM)
        if room.all():
            return room
        beats: Flags = np.greater(self.frequency(h), self.frequency(victims))
        return room | beats


ADMISSION_POLICIES: Mapping[str, type[AdmissionPolicy]] = MappingProxyType(
    {"always": AlwaysAdmit, "second-use": SecondUse, "tinylfu": TinyLFU}
)
"""The built-in policies by name (the ``admission_*`` settings' choices)."""


def policy_class(name: str, setting: str = "admission policy") -> type[AdmissionPolicy]:
    """The policy called ``name`` (built in, or ``package.module:Class``); a clear error naming
    ``setting`` and the known names otherwise."""
    cls = ADMISSION_POLICIES.get(name)
    if cls is not None:
        return cls
    known = ", ".join(ADMISSION_POLICIES)
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"{setting}: unknown admission policy {name!r}; known: {known} (or package.module:Class)"
        )
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{setting}: admission policy {name!r} cannot be loaded: {exc}") from exc
    if not (isinstance(found, type) and issubclass(found, AdmissionPolicy)):
        raise ConfigError(f"{setting}: {name!r} is not an AdmissionPolicy subclass")
    return found


def make_admission(
    name: str, settings: AdmissionSettings, setting: str = "admission policy"
) -> AdmissionPolicy:
    """The policy called ``name``, built for ``settings``."""
    return policy_class(name, setting)(settings)
