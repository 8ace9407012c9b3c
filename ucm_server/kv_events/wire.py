"""vLLM's KV event wire format, encoded with plain msgpack (the daemon never imports vLLM).

vLLM (``vllm/distributed/kv_events.py``) sends each ``KVEventBatch`` as three ZeroMQ frames:
``topic`` (UTF-8), ``seq`` (8 bytes, big-endian) and a msgspec-msgpack payload. The batch is an
``array_like`` struct, ``[ts, events, data_parallel_rank]``; each event is a *tagged* struct, a map
whose ``"type"`` names the class, fields in declaration order, fields equal to their default left
out (``omit_defaults``). The replay socket (ROUTER) answers a request ``[identity, b"", start_seq]``
with ``[identity, b"", topic, seq, payload]`` per batch and ends with ``seq = -1`` and an empty
payload. ``tests/test_kv_events.py`` decodes what this module writes with vLLM's own classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgpack

__all__ = ["END_SEQ", "Cleared", "Removed", "Stored", "encode_batch", "external_hashes", "seq_bytes"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay marker, as vLLM's ``ZmqEventPublisher.END_SEQ``."""


@dataclass(frozen=True, slots=True)
class Stored:
    """vLLM's ``BlockStored``: ``hashes`` are now held in ``medium`` (by the tier ``ownership``)."""

    hashes: Sequence[bytes] | Sequence[int]
    medium: str
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    """vLLM's ``BlockRemoved``: ``hashes`` are no longer held in ``medium``."""

    hashes: Sequence[bytes] | Sequence[int]
    medium: str
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    """vLLM's ``AllBlocksCleared``: forget everything this publisher said before."""


Event = Stored | Removed | Cleared


def _event(event: Event) -> dict[str, object]:
    if isinstance(event, Stored):
        # BlockStored's fields without defaults are always present; token ids and the parent
        # hash are unknown to a store that holds bytes by key (empty / None, as vLLM allows).
        out: dict[str, object] = {
            "type": "BlockStored",
            "block_hashes": list(event.hashes),
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": 0,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
        }
    elif isinstance(event, Removed):
        out = {"type": "BlockRemoved", "block_hashes": list(event.hashes), "medium": event.medium}
    else:
        return {"type": "AllBlocksCleared"}
    if event.ownership is not None:
        out["ownership"] = event.ownership
    return out


def encode_batch(ts: float, events: Sequence[Event], data_parallel_rank: int | None = None) -> bytes:
    """One ``KVEventBatch`` payload, byte for byte what vLLM's msgspec encoder writes for it."""
    payload: bytes = msgpack.packb([ts, [_event(e) for e in events], data_parallel_rank], use_bin_type=True)
    return payload


HashFormat = Literal["int64", "bytes"]


def external_hashes(digests: Sequence[bytes], fmt: HashFormat) -> list[bytes] | list[int]:
    """Digests as vLLM's events carry block hashes: vLLM's ``maybe_convert_block_hash`` turns its
    32-byte hash into the unsigned integer of its last 8 bytes unless
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (then the bytes are sent as they are)."""
    if fmt == "bytes":
        return list(digests)
    return [int.from_bytes(d[-8:], "big") for d in digests]


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)
