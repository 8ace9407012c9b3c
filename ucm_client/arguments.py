"""Checks of what a caller hands the client, before it becomes a protobuf message.

Without them a careless caller met whatever the protobuf runtime or asyncio raised: a bare
``TypeError`` for a ``str`` key, ``ValueError: Value out of range: -1`` for a negative offset (naming
no field), ``AttributeError`` for a tuple in place of a :class:`~ucm_client.types.BlockIO`, an
immediate ``DeadlineExceeded`` for a NaN timeout, and a generator of keys reported as "this UcmClient
is closed". Every such mistake is now an :class:`~ucm_client.errors.InvalidArgument` (for a wrong
type, :class:`~ucm_client.errors.ArgumentTypeError`, also a ``TypeError``) naming the argument and
the item. Lengths of keys and namespaces are left to the daemon, which names them the same way.

The hot paths pay nothing on good input: batches are built first and only a refused build walks
the arguments again to name the culprit (:func:`explain_batch`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ucm_client import types
from ucm_client.errors import ArgumentTypeError, InvalidArgument
from ucm_client.types import BlockIO, Segment
from ucm_protocol.ucm.v1 import ucm_pb2 as pb

U64_LIMIT = 1 << 64
BYTES_LIKE = (bytes, bytearray, memoryview)


def _kind(value: object) -> str:
    return type(value).__name__


def namespace_arg(namespace: object) -> bytes:
    """A namespace as bytes (its length is the daemon's to check)."""
    if type(namespace) is bytes:
        return namespace
    if isinstance(namespace, BYTES_LIKE):
        return bytes(namespace)
    raise ArgumentTypeError(f"namespace must be 16 bytes (bytes), got {_kind(namespace)}")


def key_list(keys: object, what: str = "keys") -> list[Any]:
    """``keys`` as a list (a generator is read once); one key or a string in place of the list is refused."""
    if isinstance(keys, (str, *BYTES_LIKE)):
        raise ArgumentTypeError(
            f"{what} must be a sequence of 32-byte keys, got one {_kind(keys)} (wrap a single key in a list)"
        )
    if type(keys) is list:
        return keys
    if not isinstance(keys, Iterable):
        raise ArgumentTypeError(f"{what} must be a sequence of 32-byte keys, got {_kind(keys)}")
    return list(keys)


def keys_arg(keys: object, what: str = "keys") -> list[bytes]:
    """Every key as bytes; the first that is not bytes-like is named by its index."""
    items = key_list(keys, what)
    out: list[bytes] = []
    for i, key in enumerate(items):
        if type(key) is bytes:
            out.append(key)
        elif isinstance(key, BYTES_LIKE):
            out.append(bytes(key))
        else:
            raise ArgumentTypeError(f"{what}[{i}] must be bytes, got {_kind(key)}")
    return out


def integer_arg(value: object, name: str, low: int = 0, high: int = U64_LIMIT) -> int:
    """An exact integer (numpy's too; not a bool or float) in ``[low, high)``."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:  # numpy integers and other exact integer types
            value = int(value.__index__())  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            raise ArgumentTypeError(f"{name} must be an integer, got {_kind(value)}") from None
    if not low <= value < high:
        raise InvalidArgument(f"{name} must be in [{low}, {high}), got {value}")
    return value


def task_id_arg(task_id: object) -> int:
    return integer_arg(task_id, "task_id")


def seconds_arg(value: object, name: str) -> float:
    """A number of seconds (negative counts as 0, infinity as the daemon's cap); NaN is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number of seconds, got {_kind(value)}")
    if math.isnan(value):
        raise InvalidArgument(f"{name} must be a number of seconds, got nan")
    return float(value)


def positive_seconds_arg(value: object, name: str) -> float:
    """A timeout setting: a finite number of seconds above 0 (0, negative or NaN would fail every call)."""
    seconds = seconds_arg(value, name)
    if not 0 < seconds < math.inf:
        raise InvalidArgument(f"{name} must be a finite number of seconds above 0, got {seconds}")
    return seconds


def size_arg(value: object, name: str) -> int:
    return integer_arg(value, name, low=1)


def explain_batch(blocks: object) -> InvalidArgument:
    """Why ``blocks`` could not become a batch: the first block, segment or field that is wrong."""
    if not isinstance(blocks, Sequence) or isinstance(blocks, (str, *BYTES_LIKE)):
        return ArgumentTypeError(f"blocks must be a sequence of BlockIO, got {_kind(blocks)}")
    for i, block in enumerate(blocks):
        if not isinstance(block, BlockIO):
            return ArgumentTypeError(f"blocks[{i}] must be a BlockIO, got {_kind(block)}")
        if not isinstance(block.key, BYTES_LIKE):
            return ArgumentTypeError(f"blocks[{i}].key must be bytes, got {_kind(block.key)}")
        if not isinstance(block.segments, (tuple, list)):
            kind = _kind(block.segments)
            return ArgumentTypeError(f"blocks[{i}].segments must be a tuple of Segment, got {kind}")
        for j, seg in enumerate(block.segments):
            where = f"blocks[{i}].segments[{j}]"
            if not isinstance(seg, Segment):
                return ArgumentTypeError(f"{where} must be a Segment, got {_kind(seg)}")
            try:
                integer_arg(seg.region, f"{where}.region")
                integer_arg(seg.offset, f"{where}.offset")
                integer_arg(seg.length, f"{where}.length")
            except InvalidArgument as exc:
                return exc
    return InvalidArgument("blocks could not be sent (no single field found wrong)")


def put_items_arg(items: object) -> list[tuple[bytes, bytes]]:
    """``(key, data)`` pairs for put_blocks, each part bytes-like."""
    if isinstance(items, (str, *BYTES_LIKE)) or not isinstance(items, Iterable):
        raise ArgumentTypeError(f"items must be a sequence of (key, data) pairs, got {_kind(items)}")
    out: list[tuple[bytes, bytes]] = []
    for i, item in enumerate(items):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ArgumentTypeError(f"items[{i}] must be a (key, data) pair, got {_kind(item)}")
        key, data = item
        for part, value in (("key", key), ("data", data)):
            if not isinstance(value, BYTES_LIKE):
                raise ArgumentTypeError(f"items[{i}] {part} must be bytes, got {_kind(value)}")
        out.append((bytes(key), bytes(data)))
    return out


def lookup_request(namespace: object, keys: object) -> pb.LookupRequest:
    """:func:`ucm_client.types.lookup_request` for checked arguments. Good keys cost two C calls
    (:func:`~ucm_client.types.packed_keys`); only a refused one walks the keys to name it."""
    ns = namespace_arg(namespace)
    items = key_list(keys)
    try:
        return types.lookup_request(ns, items)
    except TypeError:
        return types.lookup_request(ns, keys_arg(items))


def block_batch(namespace: object, blocks: object, server_ids: Mapping[int, int]) -> pb.BlockBatch:
    """:func:`ucm_client.types.as_batch` for checked arguments: a refused build names the first wrong
    block, segment or field (:func:`explain_batch`) instead of the protobuf runtime's bare error."""
    ns = namespace_arg(namespace)
    try:
        return types.as_batch(ns, blocks, server_ids)  # type: ignore[arg-type]
    except (TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, InvalidArgument):  # already names what is wrong (an unknown region handle)
            raise
        raise explain_batch(blocks) from None


def client_options(
    target: object, client_name: object, token: object, daemon_uid: object, timeouts: Mapping[str, object]
) -> None:
    """The constructor arguments of both clients, checked before anything starts (the blocking client
    starts a loop thread, which a refused argument used to leave running)."""
    if target is not None and not isinstance(target, (str, os.PathLike)):
        raise ArgumentTypeError(f"target must be a socket path or a gRPC target string, got {_kind(target)}")
    if not isinstance(client_name, str):
        raise ArgumentTypeError(f"client_name must be a str, got {_kind(client_name)}")
    if token is not None and not isinstance(token, str):
        raise ArgumentTypeError(f"token must be a str, got {_kind(token)}")
    if daemon_uid is not None:
        integer_arg(daemon_uid, "daemon_uid", 0, 1 << 32)
    for name, value in timeouts.items():
        positive_seconds_arg(value, name)


def read_tls_file(path: str | os.PathLike[str] | None, name: str) -> bytes | None:
    """A PEM file named by ``tls_ca``/``tls_cert``/``tls_key``; a missing or unreadable one is named."""
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{name} {path}: cannot read it ({exc.strerror or exc})") from None
