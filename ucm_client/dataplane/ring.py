"""The client's side of a session's ring: Load/Dump submitted into shared memory, answers read back.

A submission writes its body into the arena (:func:`ucm_protocol._native.encode_batch`: the block
descriptions straight into shared memory, no protobuf), then an entry into the submission queue,
then rings the doorbell (one byte on the channel's connection). A thread of this client reads the
completion queue whenever the daemon rings back, and settles what waits: the answer to a submission
(its task id, or the daemon's refusal as the same error the RPC raises) and the end of a task.

The arena is used first-in first-out: a body's space is free again once the daemon answered its
submission (it copied the body out before checking anything). Threads may submit and wait at once;
submissions are serialised by a lock (a few microseconds each), waits are not.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import mmap
import select
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ucm_protocol import dataplane as dp
from ucm_protocol.errors import Unavailable, error_for_status
from ucm_protocol.native import native

_U32 = 0xFFFFFFFF
_CODES = {int(c.value[0]): c for c in grpc.StatusCode}
KEEP_FINISHED = 4096
"""Task ends kept for tasks nobody has waited for yet (oldest dropped: their wait asks gRPC)."""
KEEP_DROPPED = 1 << 16
"""Ids of dropped task ends remembered, as many as the client remembers ring tasks."""


@dataclass(frozen=True, slots=True)
class Submitted:
    task_id: int
    progress: bool
    """A Load's progress word was taken by the daemon."""
    store_saturated: bool = False
    """The daemon's back-pressure flag at submission (``TaskHandle.store_saturated``)."""


@dataclass(frozen=True, slots=True)
class Finished:
    task_id: int
    state: int
    all_ok: bool
    bytes_done: int
    elapsed_s: float
    nblocks: int


class RingClosed(Exception):
    """The ring cannot take a submission (the channel ended): use gRPC."""


class _Arena:
    """First-in first-out space in the ring's arena: bodies are freed in the order they were written."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._live: collections.deque[tuple[int, int, int]] = collections.deque()  # (user_data, start, end)
        self._done: set[int] = set()

    def window(self) -> tuple[int, int]:
        """The largest run of free space where the next body may go: (start, limit)."""
        if not self._live:
            return 0, self.size
        head = self._live[0][1]
        tail = self._live[-1][2]
        if tail > head:  # free: [tail, size) and [0, head)
            return (tail, self.size) if self.size - tail >= head else (0, head)
        return tail, head

    def taken(self, user_data: int, start: int, nbytes: int) -> None:
        self._live.append((user_data, start, start + ((nbytes + 7) & ~7)))

    def free(self, user_data: int) -> None:
        self._done.add(user_data)
        while self._live and self._live[0][0] in self._done:
            self._done.discard(self._live.popleft()[0])

    @property
    def empty(self) -> bool:
        return not self._live


class RingClient:
    def __init__(self, conn: socket.socket, ring: mmap.mmap, *, name: str = "ucm") -> None:
        assert native is not None
        self.conn = conn
        self.map = ring
        header = dp.RING_HEADER.unpack_from(ring, 0)
        magic, version, _header, _gen, sq_entries, cq_entries, sq_at, cq_at, msg_at, arena_at, arena_bytes = (
            header
        )
        size = len(ring)
        ok = magic == dp.RING_MAGIC and version == dp.VERSION
        for entries in (sq_entries, cq_entries):
            ok = ok and entries > 0 and entries & (entries - 1) == 0
        ok = ok and sq_at + sq_entries * dp.SQE_BYTES <= size and cq_at + cq_entries * dp.CQE_BYTES <= size
        ok = ok and msg_at + cq_entries * dp.MESSAGE_BYTES <= size and arena_at + arena_bytes <= size
        if not ok:
            raise Unavailable("the daemon's ring does not have the layout this client knows")
        self._sq_entries, self._cq_entries = sq_entries, cq_entries
        self._sq_at, self._cq_at, self._msg_at, self._arena_at = sq_at, cq_at, msg_at, arena_at
        self.arena_bytes = arena_bytes
        self._arena = _Arena(arena_bytes)
        self._arena_view = memoryview(ring)[arena_at : arena_at + arena_bytes]
        self._sq_tail = native.load_u32(ring, dp.R_SQ_TAIL)
        self._cq_head = native.load_u32(ring, dp.R_CQ_HEAD)
        self._submit_lock = threading.Lock()
        self._cond = threading.Condition()
        self._next_user_data = 1
        self._answers: dict[int, concurrent.futures.Future[Submitted]] = {}
        self._finished: collections.OrderedDict[int, Finished] = collections.OrderedDict()
        self.keep_finished = KEEP_FINISHED
        self._dropped: collections.OrderedDict[int, None] = collections.OrderedDict()
        """Tasks whose end came and was dropped to stay within ``keep_finished``: a wait on one
        answers at once (the caller asks gRPC) instead of waiting for an end that already came."""
        self.dead = ""
        """Why the ring is unusable ("" while it works)."""
        self._thread = threading.Thread(target=self._complete, name=f"{name}-ring", daemon=True)
        self._thread.start()

    # -- submissions --------------------------------------------------------------------------------------
    def submit(
        self,
        op: int,
        namespace: bytes,
        blocks: Sequence[Any],
        server_ids: dict[int, int],
        *,
        flags: int = 0,
        progress: tuple[int, int, int] | None = None,
        timeout_s: float = 10.0,
    ) -> concurrent.futures.Future[Submitted] | None:
        """Queue a Load/Dump; its answer in the future. None: this request does not fit the ring (a
        block, segment or handle not exactly as expected, or larger than the arena): use gRPC."""
        assert native is not None
        with self._submit_lock:
            if self.dead:
                raise RingClosed(self.dead)
            encoded = self._encode(namespace, blocks, server_ids, timeout_s)
            if encoded is None:
                return None
            start, (nbytes, nblocks, nseg, multi) = encoded
            user_data = self._next_user_data
            self._next_user_data += 1
            if multi:
                flags |= dp.SQF_MULTI
            p_region, p_offset, p_length = progress or (0, 0, 0)
            if progress is not None:
                flags |= dp.SQF_PROGRESS
            entry = dp.SQE.pack(
                op, flags, 0, nblocks, user_data, start, nbytes, nseg, 0, p_region, p_offset, p_length
            )
            if not self._wait_for(lambda: self._sq_room() > 0, timeout_s):
                raise RingClosed(self.dead or "the daemon takes no submissions (its queue stayed full)")
            future: concurrent.futures.Future[Submitted] = concurrent.futures.Future()
            with self._cond:
                self._arena.taken(user_data, start, nbytes)
                self._answers[user_data] = future
            at = self._sq_at + (self._sq_tail % self._sq_entries) * dp.SQE_BYTES
            self.map[at : at + dp.SQE_BYTES] = entry
            self._sq_tail = (self._sq_tail + 1) & _U32
            native.store_u32(self.map, dp.R_SQ_TAIL, self._sq_tail)  # after the entry and its body
            self._bell()
            return future

    def _encode(
        self, namespace: bytes, blocks: Sequence[Any], server_ids: dict[int, int], timeout_s: float
    ) -> tuple[int, tuple[int, int, int, bool]] | None:
        """The body written into the arena: (its offset, what encode_batch said), waiting for space
        (answers free it) when the arena is busy; None when it cannot go by the ring."""
        assert native is not None
        for _ in range(2):
            with self._cond:
                start, limit = self._arena.window()
                was_empty = self._arena.empty
            done = native.encode_batch(self._arena_view, start, limit, namespace, blocks, server_ids)
            if done is not None:
                return start, done
            if was_empty:
                return None  # not a matter of space: the checked path says what is wrong, or sends it
            if not self._wait_for(lambda: self._arena.empty, timeout_s):
                return None
        return None

    def track(self, namespace: bytes) -> None:
        """Ask for ``namespace`` to be listed in this tenant's presence table (no answer). The 16
        bytes travel in the entry itself, where a Load's progress word would."""
        assert native is not None
        with self._submit_lock:
            if self.dead or self._sq_room() <= 0 or len(namespace) != 16:
                return
            low, high = int.from_bytes(namespace[:8], "little"), int.from_bytes(namespace[8:], "little")
            entry = dp.SQE.pack(dp.OP_TRACK, 0, 0, 0, 0, 0, 0, 0, 0, low, high, 0)
            at = self._sq_at + (self._sq_tail % self._sq_entries) * dp.SQE_BYTES
            self.map[at : at + dp.SQE_BYTES] = entry
            self._sq_tail = (self._sq_tail + 1) & _U32
            native.store_u32(self.map, dp.R_SQ_TAIL, self._sq_tail)
            self._bell()

    def _sq_room(self) -> int:
        assert native is not None
        head = native.load_u32(self.map, dp.R_SQ_HEAD)
        room: int = self._sq_entries - ((self._sq_tail - head) & _U32)
        return room

    def _bell(self) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            try:
                self.conn.send(dp.DOORBELL, socket.MSG_DONTWAIT)
            except OSError as exc:
                if not isinstance(exc, BlockingIOError):
                    self._die(f"the data-plane connection failed: {exc}")

    def _wait_for(self, predicate: Any, timeout_s: float) -> bool:
        with self._cond:
            return (
                bool(self._cond.wait_for(lambda: predicate() or bool(self.dead), timeout_s)) and not self.dead
            )

    # -- completions ----------------------------------------------------------------------------------
    def _complete(self) -> None:
        """This client's completion thread: wake on the daemon's doorbell, settle what it answered."""
        poller = select.poll()
        poller.register(self.conn.fileno(), select.POLLIN | select.POLLRDHUP)
        try:
            while not self.dead:
                events = poller.poll(1000)
                if self.dead:
                    return
                for _fd, mask in events:
                    if mask & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL):
                        self._drain()
                        self._die("the daemon closed the data-plane connection")
                        return
                    try:
                        if not self.conn.recv(4096, socket.MSG_DONTWAIT):
                            self._die("the daemon closed the data-plane connection")
                            return
                    except BlockingIOError:
                        pass
                self._drain()
        except (OSError, ValueError) as exc:
            self._die(f"the data-plane connection failed: {exc}")

    def _drain(self) -> None:
        assert native is not None
        tail = native.load_u32(self.map, dp.R_CQ_TAIL)
        if (tail - self._cq_head) & _U32 > self._cq_entries:
            self._die("the daemon's completion queue is out of range")
            return
        taken = 0
        settled: list[tuple[concurrent.futures.Future[Submitted], Submitted | BaseException]] = []
        with self._cond:
            while self._cq_head != tail:
                settled.extend(self._take_completion(self._cq_head % self._cq_entries))
                self._cq_head = (self._cq_head + 1) & _U32
                taken += 1
            native.store_u32(self.map, dp.R_CQ_HEAD, self._cq_head)
            if taken:
                self._cond.notify_all()
        for future, outcome in settled:  # outside the lock: the futures' callbacks run here
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        if taken >= self._cq_entries // 2:
            self._bell()  # the daemon may hold answers for a full queue: room again

    def _take_completion(
        self, slot: int
    ) -> list[tuple[concurrent.futures.Future[Submitted], Submitted | BaseException]]:
        """One completion (lock held): a task's end is kept; an answer settles its submission (after
        the lock is let go: returned)."""
        fields = dp.CQE.unpack_from(self.map, self._cq_at + slot * dp.CQE_BYTES)
        user_data, kind, state, all_ok, progress, status, task_id, done, elapsed, msg_len, nblocks, full = (
            fields
        )
        if kind == dp.CQ_FINISHED:
            self._finished[task_id] = Finished(task_id, state, bool(all_ok), done, elapsed, nblocks)
            while len(self._finished) > self.keep_finished:
                dropped, _ = self._finished.popitem(last=False)
                self._dropped[dropped] = None
            while len(self._dropped) > KEEP_DROPPED:
                self._dropped.popitem(last=False)
            return []
        self._arena.free(user_data)
        future = self._answers.pop(user_data, None)
        if future is None:
            return []
        if kind == dp.CQ_SUBMITTED:
            return [(future, Submitted(task_id, bool(progress), bool(full)))]
        at = self._msg_at + slot * dp.MESSAGE_BYTES
        reason = bytes(self.map[at : at + min(msg_len, dp.MESSAGE_BYTES)]).decode(errors="replace")
        return [(future, error_for_status(_CODES.get(status, grpc.StatusCode.UNKNOWN), reason))]

    def wait_finished(self, task_id: int, timeout_s: float) -> Finished | None:
        """The end of ``task_id`` (a task this ring submitted) within ``timeout_s``, else None."""
        with self._cond:
            if task_id not in self._finished and task_id not in self._dropped and timeout_s > 0:
                self._cond.wait_for(lambda: task_id in self._finished or bool(self.dead), timeout_s)
            return self._finished.get(task_id)

    def peek_finished(self, task_id: int) -> Finished | None:
        with self._cond:
            return self._finished.get(task_id)

    def count_lookup(self, keys: int, hits: int) -> None:
        """Add a lookup answered from the table to the counts the daemon reports (its figures)."""
        assert native is not None
        m = self.map
        native.add_u64(m, dp.R_LOOKUPS, 1)
        native.add_u64(m, dp.R_LOOKUP_KEYS, keys)
        native.add_u64(m, dp.R_LOOKUP_HITS, hits)
        native.store_u64(m, dp.R_LAST_KEYS, keys)
        native.store_u64(m, dp.R_LAST_HITS, hits)

    # -- the end --------------------------------------------------------------------------------------
    def _die(self, reason: str) -> None:
        with self._cond:
            if self.dead:
                return
            self.dead = reason
            answers, self._answers = self._answers, {}
            self._cond.notify_all()
        for future in answers.values():
            if not future.done():
                future.set_exception(Unavailable(f"{reason}: the request's fate is unknown"))

    def close(self) -> None:
        self._die("the client closed its data-plane channel")
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self.conn.close()
        self._arena_view.release()
        with contextlib.suppress(BufferError):
            self.map.close()
