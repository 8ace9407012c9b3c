"""A cap on the block bytes the daemon holds for replies it is sending (``GetBlocks``).

``GetBlocks`` answers with the blocks' bytes on a stream, one message per block: each message is
read into memory of the daemon's own and stays there until gRPC has sent it. One stream holds one
block at a time, but nothing bounds how many streams run at once, so a client that opens many (or
reads slowly on many) would make the daemon hold their blocks all together — up to
``max_block_bytes`` each — until the kernel kills it. Here every reply first takes its block's bytes
from one budget shared by all RPCs and gives them back once sent; a reply that does not fit waits its
turn instead. A block larger than the whole budget is sent alone.

Giving bytes back never awaits: a stream the client abandons is closed by gRPC from wherever it
happens to be, and what it held must come back even then.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["ReplyBudget"]


class ReplyBudget:
    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"reply budget must be positive, got {limit}")
        self.limit = limit
        self.held = 0
        """Bytes taken now (read by metrics and tests)."""
        self.waits = 0
        """Replies that had to wait for bytes (a budget too small, or a client reading slowly)."""
        self._freed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Hold ``nbytes`` (at most the whole budget) for the body of the ``async with``."""
        want = min(max(nbytes, 0), self.limit)
        if self.held + want > self.limit:
            self.waits += 1
            while self.held + want > self.limit:
                self._freed.clear()
                await self._freed.wait()
        self.held += want
        try:
            yield
        finally:
            self.held -= want
            self._freed.set()
