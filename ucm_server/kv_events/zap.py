"""The ZAP handler of the CURVE event sockets: a known public key is admitted as its audience.

ZeroMQ asks the context's ZAP handler (a REP socket on ``inproc://zeromq.zap.01``, RFC 27) about
every CURVE handshake; the answer's user id becomes the connection's ``User-Id`` property, which
the publisher reads from each subscription and replay request. It must be bound before any CURVE
socket: without a handler, a CURVE server would admit every client that knows its public key
(``ZMQ_ZAP_ENFORCE_DOMAIN`` is set on the sockets as well, so a missing handler refuses instead).
Refusals are counted, not logged: a peer trying keys must not be able to fill the log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils import z85

from ucm_server.kv_events.audience import Audience

__all__ = ["ZAP_DOMAIN", "ZapHandler", "pump"]

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"ucm-kv-events"
MESSAGES_PER_TURN = 64
"""Messages one socket handles per event loop turn (a flood waits its turn; the loop stays live)."""


def pump(loop: asyncio.AbstractEventLoop, sock: zmq.Socket[Any], handle: Callable[[], None]) -> None:
    """Call ``handle`` (which reads one message) while ``sock`` has one waiting, at most
    :data:`MESSAGES_PER_TURN` times, then again on the next loop turn. ZeroMQ's descriptor only
    signals edges, so this runs on every wake-up and after the socket sends, until nothing waits."""
    for _ in range(MESSAGES_PER_TURN):
        if sock.closed or not sock.poll(0, zmq.POLLIN):
            return
        handle()
    loop.call_soon(pump, loop, sock, handle)


class ZapHandler:
    """Admits the CURVE keys of ``audiences`` (Z85 public key -> audience), each as its audience's label."""

    def __init__(self, ctx: zmq.Context[Any], audiences: dict[bytes, Audience]) -> None:
        self._audiences = audiences
        self.refused = 0
        self._sock: zmq.Socket[Any] = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self.serve)

    def serve(self) -> None:
        pump(self._loop, self._sock, self._answer)

    def _answer(self) -> None:
        frames = self._sock.recv_multipart(zmq.NOBLOCK)
        version, request_id = [*frames, b"", b""][:2]
        audience = None
        if len(frames) == 7 and frames[2] == ZAP_DOMAIN and frames[5] == b"CURVE":
            audience = self._audiences.get(z85.encode(frames[6]))
        if audience is None:
            self.refused += 1
            self._sock.send_multipart([version, request_id, b"400", b"unknown key", b"", b""])
        else:
            self._sock.send_multipart([version, request_id, b"200", b"OK", audience.label.encode(), b""])

    def close(self) -> None:
        if not self._sock.closed:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close(0)
