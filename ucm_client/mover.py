"""Moving blocks between the daemon and memory it cannot reach, through one registered bounce buffer.

The daemon copies only between its tiers and host memory a client registered. Whatever else holds
KV — a CUDA cache without IPC, vLLM's cache with zero copy off, the pages a sparse method's cold
blocks are loaded into — exchanges bytes with it through a :class:`BlockMover`: a ``SharedBuffer``
cut into equal *slots* (one block each, however the caller defines a block), a pool of free slots,
the copies between slots and the caller's tensors, and the daemon conversation over slots.

Two ways to use it, one object:

- *one slot per block, the caller waits*: :meth:`BlockMover.acquire` slots, :meth:`copy_in` (saves)
  or :meth:`copy_out` (loads) around the caller's own task; the vLLM staging path does this, since
  its worker polls tasks across steps (``ucm_client.vllm.staging``);
- *a whole transfer here*: :meth:`BlockMover.move` cuts any number of blocks into chunks that fit the
  free slots, fills, submits and waits each chunk, and hands the loaded slots back; cold KV does this
  (``ucm_client.sparse.coldkv.worker``), and sends a load a layer ahead with :meth:`submit`.

Per-block outcomes are data (``BlockState`` per block); deciding what a failed block means is the
caller's job.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ucm_client.buffers import SharedBuffer
from ucm_client.sync import UcmClient
from ucm_client.types import BlockIO, BlockState, Segment

__all__ = ["BlockMover", "Moved", "Pieces"]

Pieces = Sequence[torch.Tensor]
"""A block's bytes outside the buffer, in slot order (e.g. each layer's page); any device and dtype."""


@dataclass(slots=True)
class Moved:
    """What :meth:`BlockMover.move` did: a state per key, and the daemon's reasons for those not OK."""

    states: list[BlockState] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    tasks: int = 0

    @property
    def ok(self) -> bool:
        return all(state is BlockState.OK for state in self.states)

    def failed(self) -> list[int]:
        """Indices of the keys that did not move."""
        return [i for i, state in enumerate(self.states) if state is not BlockState.OK]


class BlockMover:
    """``num_slots`` slots of ``slot_bytes`` in one shared buffer, and moves through them."""

    def __init__(self, slot_bytes: int, num_slots: int, *, label: str) -> None:
        if slot_bytes < 1 or num_slots < 1:
            raise ValueError(f"a mover needs one slot of one byte at least, got {num_slots} x {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.buffer = SharedBuffer(num_slots * slot_bytes, label=label)
        self._host = self.buffer.torch()
        self._free = list(range(num_slots - 1, -1, -1))
        self.region: int | None = None
        """The buffer's daemon region once :meth:`register` ran."""

    # ------------------------------------------------------------ slots
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self, count: int) -> list[int] | None:
        """``count`` free slots (lowest first), or None if the pool is short."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def release(self, slots: Sequence[int]) -> None:
        self._free.extend(reversed(slots))

    def slot(self, slot: int) -> torch.Tensor:
        """The bytes of ``slot`` (a uint8 view of the buffer)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside the mover's {self.num_slots} slots")
        return self._host[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def view(self, slot: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """``slot``'s bytes as a ``dtype`` tensor of ``shape`` (no copy), to copy parts of a block."""
        return self.slot(slot).view(dtype).view(tuple(shape))

    def segments(self, region: int, slot: int) -> tuple[Segment, ...]:
        return (Segment(region, slot * self.slot_bytes, self.slot_bytes),)

    # ------------------------------------------------------------ copies
    def copy_in(self, slots: Sequence[int], blocks: Sequence[Pieces]) -> None:
        """Copy each block's pieces into its slot (and wait for a device, so the daemon reads final bytes)."""
        for slot, pieces in zip(slots, blocks, strict=True):
            for piece, host in self._pair(slot, pieces):
                host.copy_(piece.reshape(-1).view(torch.uint8), non_blocking=True)
        self._sync(blocks)

    def copy_out(self, slots: Sequence[int], blocks: Sequence[Pieces]) -> None:
        """Copy each slot into its block's pieces (and wait for a device, so the next kernel sees them)."""
        for slot, pieces in zip(slots, blocks, strict=True):
            for piece, host in self._pair(slot, pieces):
                piece.view(-1).view(torch.uint8).copy_(host, non_blocking=True)
        self._sync(blocks)

    def _pair(self, slot: int, pieces: Pieces) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raw = self.slot(slot)
        pairs, offset = [], 0
        for piece in pieces:
            size = piece.numel() * piece.element_size()
            if offset + size > self.slot_bytes:
                raise ValueError(f"pieces of {offset + size} bytes do not fit a {self.slot_bytes}-byte slot")
            pairs.append((piece, raw[offset : offset + size]))
            offset += size
        return pairs

    @staticmethod
    def _sync(blocks: Sequence[Pieces]) -> None:
        device = next((p.device for pieces in blocks for p in pieces), None)
        if device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    # ------------------------------------------------------------ daemon
    def register(self, client: UcmClient, label: str | None = None) -> int:
        self.region = client.register(self.buffer, label=label if label is not None else self.buffer.label)
        return self.region

    def ios(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[BlockIO]:
        """Block ``keys[i]`` read from or written to ``slots[i]``."""
        if self.region is None:
            raise RuntimeError("the mover's buffer is not registered with a daemon")
        region = self.region
        return [BlockIO(key, self.segments(region, slot)) for key, slot in zip(keys, slots, strict=True)]

    def submit(
        self, client: UcmClient, op: str, namespace: bytes, keys: Sequence[bytes], slots: Sequence[int]
    ) -> concurrent.futures.Future[int]:
        """Send a ``load`` or ``dump`` of ``keys`` through ``slots`` without waiting (the task id arrives)."""
        ios = self.ios(keys, slots)
        return client.load_nowait(namespace, ios) if op == "load" else client.dump_nowait(namespace, ios)

    def move(
        self,
        client: UcmClient,
        op: str,
        namespace: bytes,
        keys: Sequence[bytes],
        *,
        timeout_s: float,
        fill: Callable[[int, int], None] | None = None,
        take: Callable[[int, int], None] | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> Moved:
        """``load`` or ``dump`` every key, as many per task as there are free slots; state per key.

        ``fill(i, slot)`` writes block ``i``'s bytes into ``slot`` before a dump; ``take(i, slot)``
        reads a loaded block ``i`` out of ``slot`` (only blocks that loaded OK). ``meanwhile`` runs
        once, after the first task is sent and before it is waited for. A task that does not end in
        ``timeout_s`` is cancelled and its blocks are ``FAILED``.
        """
        if op not in ("load", "dump"):
            raise ValueError(f"op must be 'load' or 'dump', got {op!r}")
        moved = Moved()
        start = 0
        while start < len(keys):
            slots = self.acquire(min(len(keys) - start, self.free_slots))
            if not slots:
                raise RuntimeError(f"the mover's {self.num_slots} slots are all in use")
            try:
                batch = range(start, start + len(slots))
                if fill is not None:
                    for i, slot in zip(batch, slots, strict=True):
                        fill(i, slot)
                ios = self.ios([keys[i] for i in batch], slots)
                task_id = client.load(namespace, ios) if op == "load" else client.dump(namespace, ios)
                if meanwhile is not None:
                    meanwhile()
                    meanwhile = None
                result = client.wait(task_id, timeout_s, cancel_on_timeout=True)
                moved.tasks += 1
                got = result.states if result.done and len(result.states) == len(slots) else None
                chunk = got if got is not None else [BlockState.FAILED] * len(slots)
                if got is None:
                    moved.reasons.append(f"task {task_id} did not end within {timeout_s} s")
                moved.reasons.extend(result.reasons.values())
                if take is not None:
                    for i, slot, state in zip(batch, slots, chunk, strict=True):
                        if state is BlockState.OK:
                            take(i, slot)
                moved.states.extend(chunk)
            finally:
                self.release(slots)
            start += len(slots)
        if meanwhile is not None:
            meanwhile()
        return moved

    def unregister(self, client: UcmClient) -> None:
        if self.region is not None:
            client.unregister(self.region)
            self.region = None

    def close(self) -> None:
        """Drop the buffer (after :meth:`unregister`; the daemon keeps its own mapping until then)."""
        del self._host
        self.buffer.close()
