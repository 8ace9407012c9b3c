"""The replay socket's requests: read one frame at a time within bounds, and a log that cannot flood.

A request is vLLM's ``[identity, b"", start_seq (8 bytes, big-endian)]`` on a ROUTER. Whoever can
connect can send anything, so: the socket refuses any frame above :data:`MAX_FRAME_BYTES` before
reading it (``ZMQ_MAXMSGSIZE``: ZeroMQ drops the peer instead of allocating), a request is read frame
by frame and at most :data:`MAX_FRAMES` are kept, and malformed requests are counted and logged at
most :data:`LogLimit.lines` times per :data:`LogLimit.window_s`, the next line saying how many were
left out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

__all__ = ["MAX_FRAMES", "MAX_FRAME_BYTES", "LogLimit", "ReplayRequest", "read_request"]

MAX_FRAME_BYTES = 1024
"""Largest frame a peer may send the event sockets (a replay request's frames have at most 8 bytes, a
subscription a topic; the limit covers CURVE's handshake frames and encryption overhead too);
ZeroMQ disconnects a peer that announces more, before reading it."""
MAX_FRAMES = 3


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    identity: bytes
    start: int
    user_id: str | None
    """The connection's ZeroMQ ``User-Id`` (its audience's label under CURVE), None without one."""


def read_request(sock: zmq.Socket[Any]) -> ReplayRequest | str:
    """The next request on ``sock`` (one is waiting), or what was wrong with it. Frames beyond
    :data:`MAX_FRAMES` are received and dropped one by one, never collected."""
    frames: list[zmq.Frame] = []
    count = 0
    while True:
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        count += 1
        if len(frames) < MAX_FRAMES:
            frames.append(frame)
        if not frame.more:
            break
    if count != MAX_FRAMES:
        return f"{count} frames, expected 3"
    identity, delimiter, start = (bytes(f.buffer) for f in frames)
    if delimiter or len(start) != 8:
        return f"frames of {len(delimiter)} and {len(start)} bytes, expected 0 and 8"
    try:
        user_id: str | None = str(frames[-1].get("User-Id"))
    except zmq.ZMQError:
        user_id = None
    return ReplayRequest(identity, int.from_bytes(start, "big", signed=True), user_id)


@dataclass
class LogLimit:
    """Log a kind of message at most ``lines`` times per ``window_s``; count the rest."""

    log: logging.Logger
    lines: int = 5
    window_s: float = 60.0
    suppressed: int = 0
    _window_start: float = field(default=-1e18)
    _in_window: int = 0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._window_start >= self.window_s:
            self._window_start, self._in_window = now, 0
        if self._in_window >= self.lines:
            self.suppressed += 1
            return
        self._in_window += 1
        if self.suppressed:
            message += " (%d more not logged in the last %.0f s)"
            args = (*args, self.suppressed, self.window_s)
            self.suppressed = 0
        self.log.warning(message, *args)
