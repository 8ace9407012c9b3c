"""A Load's progress word: how far its copy got, written into the client's own shared memory.

vLLM's connector waits for a whole-block Load at the first attention layer, though that layer reads
only the first segment (its own page) of every block: on a 4,000-token warm prefill the forward sat
out the whole 62 MiB copy (about 7 ms). With ``LoadRequest.progress`` the daemon
copies the blocks segment by segment (segment 0 of every block, then segment 1, ...) and stores,
after each round, how many leading segments of *every* block are in place; layer ``i`` waits only
for its own segment while the later ones are still being copied.

The word lives in a region the client registered, so reading it costs the client a load from its
own memory: no event, no round trip, no thread to wake. It is written by the thread doing the
copies, after them: on x86 (total store order; glibc's non-temporal ``memmove`` ends with a store
fence) a client that sees ``k`` sees the bytes of those ``k`` segments. Weaker memory models would
need a fence here.

Only counts that hold for every block are reported: the Cache tier reports them when it copies the
whole batch from memory in one ordered pass, and a task cut into several chunks reports only in its
last chunk (earlier chunks are complete by then). Anything else (a block read from disk, a miss, a
GPU region) moves the word only at the end, to :data:`LOAD_PROGRESS_DONE`, written whatever the
task's outcome; the per-block results stay in the task, so a block that failed after its first
segments were copied is still reported failed (and vLLM recomputes it).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ucm_protocol.errors import InvalidArgument
from ucm_protocol.wire import LOAD_PROGRESS_DONE
from ucm_server.regions import Region, RegionTable, SegmentColumns

__all__ = ["ProgressWord", "progress_word"]

WORD_BYTES = 8


@dataclass(slots=True, eq=False)
class ProgressWord:
    """The 8 bytes of a client region a Load reports into (see the module docstring)."""

    region: Region
    """Pinned by the task for as long as it may write here."""
    view: memoryview
    """Keeps the mapping's slice alive while ``cell`` points into it."""
    cell: ctypes.c_uint64

    def report(self, segments: int) -> None:
        """The first ``segments`` segments of every block are copied (one aligned 8-byte store)."""
        self.cell.value = segments

    def done(self) -> None:
        """The task ended: the client asks for its per-block results now."""
        self.cell.value = LOAD_PROGRESS_DONE


def progress_word(
    regions: RegionTable, session_id: str, region_id: int, offset: int, length: int, columns: SegmentColumns
) -> ProgressWord:
    """Check ``LoadRequest.progress`` and map it: 8 aligned bytes of one of the session's host
    regions, inside it and outside every destination of the Load (INVALID_ARGUMENT naming what is
    wrong otherwise). A GPU region is refused: the word is read by the client's CPU."""
    if length != WORD_BYTES:
        raise InvalidArgument(f"progress: length is {length}; the progress word is {WORD_BYTES} bytes")
    if offset % WORD_BYTES:
        raise InvalidArgument(f"progress: offset {offset} is not a multiple of {WORD_BYTES}")
    region = regions.get(session_id, region_id)
    if not isinstance(region, Region):
        raise InvalidArgument(f"progress: region {region_id} is GPU memory; the word must be host memory")
    if offset + WORD_BYTES > region.size:
        raise InvalidArgument(
            f"progress: offset {offset} + 8 is past region {region_id}'s {region.size} bytes"
        )
    rid = np.asarray(columns.region_ids, dtype=np.int64)
    start = np.asarray(columns.offsets, dtype=np.int64)
    end = start + np.asarray(columns.lengths, dtype=np.int64)
    clash = np.flatnonzero((rid == region_id) & (start < offset + WORD_BYTES) & (end > offset))
    if clash.size:
        raise InvalidArgument(
            f"progress: the word at region {region_id} offset {offset} overlaps the Load's segment "
            f"{int(clash[0])} (offset {int(start[clash[0]])}, {int(end[clash[0]] - start[clash[0]])} bytes)"
        )
    view = region.view[offset : offset + WORD_BYTES]
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    cell = ctypes.c_uint64.from_address(address)
    return ProgressWord(region, view, cell)
