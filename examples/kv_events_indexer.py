"""A small KV-aware router's index: which node holds which block in which medium, from KV events.

It is written for vLLM's KV events and nothing else (vLLM's own ``KVEventBatch`` classes, a ZeroMQ
SUB socket, vLLM's replay protocol), so it consumes ``ucm-server``'s events and a vLLM instance's
(``kv_events_config``) alike. A router asks :meth:`Indexer.score` which node holds the longest prefix
of a request's block hashes, weighting the medium (GPU beats CPU beats STORAGE beats SHARED).

Usage, against a daemon started with ``kv_events_endpoint: local`` and
``kv_events_replay_endpoint: local`` (ipc sockets in its socket directory, run as the daemon's uid)::

    python examples/kv_events_indexer.py node-a=ipc:///run/ucm/kv-events.pub,ipc:///run/ucm/kv-events.replay

(over TCP, a daemon with CURVE keys: :class:`CurveKeys`, docs/security.md)

prints each node's block count per medium as events arrive. Gaps in the sequence numbers (a
subscriber that joined late, a dropped message, a restarted daemon) are repaired by asking the
replay socket: ucm-server answers with the missed batches or, when it no longer has them, with a
snapshot of its whole index (``AllBlocksCleared`` then ``BlockStored``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

MEDIUM_WEIGHT = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5, "DISK": 0.5, "SHARED": 0.3}
"""What one block hit is worth to a router, by where it must be loaded from."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT = END_SEQ
"""A replay start no publisher buffers: ucm-server answers it with a snapshot of its index."""


@dataclass
class NodeState:
    """What one node holds: per medium, the set of block hashes; the last batch applied."""

    media: dict[str, set[bytes | int]] = field(default_factory=dict)
    seq: int = -1

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.media.clear()
            elif isinstance(event, BlockStored):
                self.media.setdefault(event.medium or "GPU", set()).update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held = self.media.get(event.medium or "GPU", set())
                held.difference_update(event.block_hashes)

    def pairs(self) -> set[tuple[str, bytes | int]]:
        """Every ``(medium, hash)`` held (for comparisons)."""
        return {(m, h) for m, hashes in self.media.items() for h in hashes}


@dataclass(frozen=True)
class CurveKeys:
    """A subscriber's ZeroMQ CURVE identity, for a daemon with ``kv_events_curve_secret_key_file``:
    the daemon's public key and this subscriber's key pair (Z85), the public one listed in the
    daemon's ``kv_events_subscribers_file``."""

    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


class NodeSubscriber:
    """One node's event stream: a SUB socket plus the replay socket that repairs gaps."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        replay_endpoint: str | None,
        curve: CurveKeys | None = None,
        topic: bytes = b"",
    ) -> None:
        self.state = NodeState()
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.sub = ctx.socket(zmq.SUB)
        if curve is not None:
            curve.apply(self.sub)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint:
            self._replay = ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                curve.apply(self._replay)
            self._replay.connect(replay_endpoint)

    def sync(self, start: bytes = SNAPSHOT, timeout_s: float = 10.0) -> None:
        """Ask the replay socket for batches from ``start`` (default: a snapshot) and apply them."""
        if self._replay is None:
            return
        deadline = time.monotonic() + timeout_s
        if not self._replay.poll(int(timeout_s * 1000), zmq.POLLOUT):  # not connected (yet)
            raise TimeoutError("the replay socket accepted no connection")
        self._replay.send_multipart([b"", start])
        while time.monotonic() < deadline:
            if not self._replay.poll(100):
                continue
            _, _topic, seq_bytes, payload = self._replay.recv_multipart()
            if seq_bytes == END_SEQ:
                return
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            batch = self._decoder.decode(payload)
            if seq > self.state.seq or _is_snapshot(batch):  # a snapshot replaces what we had
                self.state.apply(batch)
                self.state.seq = seq
        raise TimeoutError("no end of replay")

    def poll(self, timeout_ms: int = 100) -> int:
        """Apply every batch waiting on the SUB socket; returns how many were applied."""
        applied = 0
        while self.sub.poll(timeout_ms if applied == 0 else 0):
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq <= self.state.seq:
                continue  # already applied (a snapshot or a replay covered it)
            if seq != self.state.seq + 1 and self._replay is not None:
                # A gap: joined late, a message dropped, or the publisher restarted (ucm-server's
                # numbers keep growing across restarts). Ask for what was missed from the next one.
                self.sync((self.state.seq + 1).to_bytes(8, "big", signed=True))
                if seq <= self.state.seq:
                    continue
            self.state.apply(self._decoder.decode(payload))
            self.state.seq = seq
            applied += 1
        return applied

    def close(self) -> None:
        self.sub.close(0)
        if self._replay is not None:
            self._replay.close(0)


def _is_snapshot(batch: KVEventBatch) -> bool:
    return bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)


class Indexer:
    """Every node's state; :meth:`score` is the router's question."""

    def __init__(self, nodes: dict[str, tuple[str, str | None]]) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.nodes = {name: NodeSubscriber(self.ctx, pub, rep) for name, (pub, rep) in nodes.items()}

    def poll(self, timeout_ms: int = 100) -> None:
        for node in self.nodes.values():
            node.poll(timeout_ms)

    def score(self, block_hashes: Sequence[bytes | int]) -> dict[str, float]:
        """Per node: the longest prefix of ``block_hashes`` it holds, each block weighted by the
        best medium holding it there (a prefix stops at the first block held nowhere)."""
        scores: dict[str, float] = {}
        for name, node in self.nodes.items():
            total = 0.0
            for h in block_hashes:
                media = [m for m, held in node.state.media.items() if h in held]
                best = max((MEDIUM_WEIGHT.get(m, 0.1) for m in media), default=0.0)
                if best == 0.0:
                    break
                total += best
            scores[name] = total
        return scores

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()
        self.ctx.term()


def _parse(args: Iterable[str]) -> dict[str, tuple[str, str | None]]:
    nodes: dict[str, tuple[str, str | None]] = {}
    for arg in args:
        name, _, endpoints = arg.partition("=")
        pub, _, replay = endpoints.partition(",")
        nodes[name] = (pub, replay or None)
    return nodes


def main(argv: Sequence[str]) -> None:
    indexer = Indexer(_parse(argv))
    for node in indexer.nodes.values():
        node.sync()
    try:
        while True:
            indexer.poll(500)
            line = "  ".join(
                f"{name}: " + ", ".join(f"{m}={len(h)}" for m, h in sorted(n.state.media.items()))
                for name, n in indexer.nodes.items()
            )
            print(line, flush=True)
    except KeyboardInterrupt:
        indexer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
