"""Typed values of the client API: block descriptions in, task results and lookups out."""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ucm_protocol.errors import InvalidArgument
from ucm_protocol.keys import KEY_BYTES, NAMESPACE_BYTES
from ucm_protocol.states import BlockState
from ucm_protocol.ucm.v1 import ucm_pb2 as pb

__all__ = [
    "KEY_BYTES",
    "NAMESPACE_BYTES",
    "BlockIO",
    "BlockState",
    "LookupResult",
    "Segment",
    "TaskResult",
    "key_digest",
    "namespace_id",
]


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` bytes at ``offset`` of the registered region ``region`` (a client-side handle)."""

    region: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class BlockIO:
    """One block: its 32-byte key and where its bytes are, in order (one segment per layer, say)."""

    key: bytes
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.segments)


@dataclass(frozen=True, slots=True)
class LookupResult:
    present: list[bool]
    hit_prefix: int

    @property
    def hits(self) -> int:
        return sum(self.present)


@dataclass(frozen=True, slots=True)
class RetentionResult:
    """What a retention change did: blocks it now applies to, keys stored nowhere, and the tiers
    where a pin is not held (``"<tier>: why"``)."""

    applied: int
    missing: int
    not_enforced: list[str]


@dataclass(frozen=True, slots=True)
class TaskResult:
    """Where a task stands; per-block states are data, not exceptions."""

    task_id: int
    done: bool
    cancelled: bool
    states: list[BlockState]
    reasons: dict[int, str] = field(default_factory=dict)
    bytes_done: int = 0
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Finished with every block OK."""
        return self.done and all(s is BlockState.OK for s in self.states)

    def indices(self, state: BlockState) -> list[int]:
        return [i for i, s in enumerate(self.states) if s is state]

    @classmethod
    def from_pb(cls, msg: pb.TaskStatus) -> TaskResult:
        reasons = dict(msg.reasons)
        return cls(
            task_id=msg.task_id,
            done=msg.state != pb.TASK_RUNNING,
            cancelled=msg.state == pb.TASK_CANCELLED,
            states=_states(msg.block_status, reasons),
            reasons=reasons,
            bytes_done=msg.bytes_done,
            elapsed_s=msg.elapsed_s,
        )


_STATES = {int(s): s for s in BlockState}


def _states(values: Sequence[int], reasons: dict[int, str]) -> list[BlockState]:
    """Wire values as states, by one C-level map over a dict: 256 ``BlockState(v)`` calls cost
    ~0.15 ms per task result, as much as a round trip's share of a small task.

    A value this client does not know (a newer daemon's) reads as FAILED, with a reason naming it:
    never as OK, and never as an exception that would lose the other blocks' states."""
    try:
        return list(map(_STATES.__getitem__, values))
    except KeyError:
        states = []
        for i, v in enumerate(values):
            state = _STATES.get(v)
            if state is None:
                state = BlockState.FAILED
                reasons.setdefault(i, f"unknown block state {v} from ucm-server (a newer daemon?)")
            states.append(state)
        return states


_STAMP = KEY_BYTES + 2
"""Bytes per key of a Pascal-string struct (``"34p"``): a length byte, then up to 33 bytes of the key
(padded). The length byte is ``min(len(key), 33)``, so it reads 32 exactly when the key is 32 bytes
long: one byte of the packed output per key says whether that key is well formed."""
_LENGTH_BYTE = bytes([KEY_BYTES])
_RUN_MAX = 4096


@functools.cache
def _stamper(count: int) -> struct.Struct:
    """The Pascal-string struct for ``count`` keys (a power of two up to ``_RUN_MAX``: at most 13
    are ever built, the largest ~130 KB)."""
    return struct.Struct(f"{_STAMP}p" * count)


def packed_keys(keys: Sequence[bytes]) -> bytes | None:
    """``keys`` concatenated if every one is exactly ``KEY_BYTES`` bytes (``bytes``/``bytearray``),
    else ``None`` (the caller then sends them one by one, so the daemon names the bad index).

    Why not ``len`` per key: ``map(len, keys)`` costs ~20 µs per 2,048 keys, twice the join itself,
    on the scheduler's hot path. A struct packs the keys as Pascal strings in one C call (~8 µs);
    its length bytes, one every ``_STAMP`` bytes, are then compared with the expected ones at once.
    Exact for any content (an all-zero key included); batches are packed in power-of-two runs of
    at most ``_RUN_MAX`` keys, so only a few small structs are ever compiled."""
    n = len(keys)
    start = 0
    try:
        while start < n:
            run = min(_RUN_MAX, 1 << ((n - start).bit_length() - 1))
            part = keys if run == n else keys[start : start + run]
            if _stamper(run).pack(*part)[::_STAMP] != _LENGTH_BYTE * run:
                return None
            start += run
    except struct.error:  # not bytes (a str, a memoryview...): the caller's slow path names it
        return None
    return b"".join(keys)


def lookup_request(namespace: bytes, keys: Sequence[bytes]) -> pb.LookupRequest:
    """Keys travel packed (one bytes field) unless one is malformed, so the daemon can name it."""
    packed = packed_keys(keys) if keys else None
    if packed is None:
        return pb.LookupRequest(namespace=namespace, keys=keys)
    return pb.LookupRequest(namespace=namespace, packed_keys=packed)


def lookup_result(resp: pb.LookupResponse) -> LookupResult:
    packed = resp.present_bytes  # one byte per key, 0 or 1: numpy turns it into bools in C
    if packed and resp.hit_prefix == len(packed):  # every key present (a repeated prompt)
        return LookupResult(present=[True] * len(packed), hit_prefix=resp.hit_prefix)
    present = np.frombuffer(packed, np.bool_).tolist() if packed else list(resp.present)
    return LookupResult(present=present, hit_prefix=resp.hit_prefix)


def namespace_id(**fields: str | int | float | bool) -> bytes:
    """The 16-byte namespace of everything that makes KV bytes incompatible (model, dtype, layout...).

    Fields are sorted, so argument order does not matter; any change of any value gives another namespace.
    """
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=NAMESPACE_BYTES).digest()


def key_digest(*parts: bytes | str | int) -> bytes:
    """A 32-byte key from arbitrary parts (for callers whose own hashes are not 32 bytes)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in parts:
        data = p if isinstance(p, bytes) else str(p).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def as_segment(segment: Segment, server_ids: Mapping[int, int]) -> pb.Segment:
    """One segment on the wire (a Load's progress word), its region handle translated."""
    try:
        region = server_ids[segment.region]
    except KeyError:
        raise InvalidArgument(f"progress word: region handle {segment.region} is not registered") from None
    return pb.Segment(region_id=region, offset=segment.offset, length=segment.length)


def as_batch(namespace: bytes, blocks: Sequence[BlockIO], server_ids: Mapping[int, int]) -> pb.BlockBatch:
    """Column-wise protobuf batch, translating client region handles to the daemon's ids (a handle
    the mapping does not know is refused here; the mapping may raise its own error for a dead one)."""
    counts: list[int] = []
    regions: list[int] = []
    offsets: list[int] = []
    lengths: list[int] = []
    single = all(len(b.segments) == 1 for b in blocks)
    for b in blocks:
        if not single:
            counts.append(len(b.segments))
        for s in b.segments:
            try:
                regions.append(server_ids[s.region])
            except KeyError:
                raise InvalidArgument(
                    f"block {b.key.hex()[:16]}: region handle {s.region!r} is not registered"
                ) from None
            offsets.append(s.offset)
            lengths.append(s.length)
    return pb.BlockBatch(
        namespace=namespace,
        keys=[b.key for b in blocks],
        segment_counts=counts,
        region_ids=regions,
        offsets=offsets,
        lengths=lengths,
    )
