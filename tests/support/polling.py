"""Waiting for state that settles asynchronously: poll a check, bounded in time, never a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(
    check: Callable[[], bool],
    timeout_s: float = 10.0,
    what: str | Callable[[], object] = "condition",
    interval_s: float = 0.05,
) -> None:
    """Poll ``check`` until it holds or ``timeout_s`` passes, then fail saying ``what`` did not hold.

    State that settles asynchronously (a session reaped after its client died, an event applied by a
    subscriber) is asserted this way rather than after a fixed sleep. ``what`` may be a function, called
    only on failure, to show the state as it was then; a ``check`` that itself waits (a subscriber's
    poll) passes ``interval_s=0``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(interval_s)
    described = what() if callable(what) else what
    raise AssertionError(f"{described} did not hold within {timeout_s}s")
