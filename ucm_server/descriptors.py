"""The daemon's file descriptors: a bounded share for what clients make it hold, the rest its own.

Clients can make the daemon hold descriptors: a connection on the fd socket (and the memfd it
carries), a memfd handed over and not yet registered, the memfd behind registered regions (kept to
check that the memory stays allocated). Each of those takes one from a :class:`DescriptorBudget`
first and gives it back when closed, so however clients behave the daemon keeps a reserve for its
own work: tier files, gRPC connections, the executor, logs. At start-up the soft ``RLIMIT_NOFILE``
is raised to the hard one (as most daemons do), capped at :data:`MAX_LIMIT`; a quarter of it, at
least :data:`RESERVED_MIN`, is the reserve.
"""

from __future__ import annotations

import logging
import resource
import threading

log = logging.getLogger(__name__)

MAX_LIMIT = 1 << 20
"""The soft limit is raised at most this far (a hard limit of "unlimited" is no reason to go further)."""
RESERVED_MIN = 256
"""Descriptors kept for the daemon's own work at least (a quarter of the limit when that is more)."""


def raise_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (at most :data:`MAX_LIMIT`); the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_LIMIT if hard == resource.RLIM_INFINITY else min(hard, MAX_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.info("descriptor limit stays at %d (raising it to %d failed: %s)", soft, target, exc)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return MAX_LIMIT if soft == resource.RLIM_INFINITY else int(soft)


class DescriptorBudget:
    """Descriptors that client actions may make the daemon hold (any thread). Parts of it can be
    carved out for one use (:meth:`carve`), so no other use can take them."""

    def __init__(self, capacity: int, *, limit: int, reserved: int) -> None:
        self.limit = limit
        self.reserved = reserved
        self.capacity = max(0, capacity)
        self._used = 0
        self._lock = threading.Lock()
        self._parent: DescriptorBudget | None = None

    @classmethod
    def for_limit(cls, limit: int) -> DescriptorBudget:
        """The share of ``limit`` that clients may make the daemon hold (the rest is its reserve)."""
        reserved = max(RESERVED_MIN, limit // 4)
        return cls(limit - reserved, limit=limit, reserved=reserved)

    @property
    def used(self) -> int:
        return self._used

    @property
    def left(self) -> int:
        return self.capacity - self._used

    def take(self, n: int = 1) -> bool:
        """Take ``n`` if they are left; whether they were."""
        with self._lock:
            if self._used + n > self.capacity:
                return False
            self._used += n
            return True

    def give(self, n: int = 1) -> None:
        with self._lock:
            self._used = max(0, self._used - n)

    def carve(self, n: int) -> DescriptorBudget:
        """A budget of ``n`` (or what is left, if less) that this one no longer counts as its own."""
        with self._lock:
            n = max(0, min(n, self.capacity - self._used))
            self.capacity -= n
        part = DescriptorBudget(n, limit=self.limit, reserved=self.reserved)
        part._parent = self
        return part

    def close(self) -> None:
        """A carved part goes back to the budget it came from (its user is done with it)."""
        parent, self._parent = self._parent, None
        if parent is not None:
            with parent._lock:
                parent.capacity += self.capacity
            self.capacity = 0

    def describe(self) -> str:
        """For refusals: what the budget is and where it comes from."""
        return (
            f"{self.capacity} descriptors for this (of the limit RLIMIT_NOFILE {self.limit}, "
            f"{self.reserved} are kept for the daemon's own work)"
        )


_process: DescriptorBudget | None = None
_process_lock = threading.Lock()


def process_budget() -> DescriptorBudget:
    """The daemon's one budget, made (and the limit raised) on first use."""
    global _process
    with _process_lock:
        if _process is None:
            _process = DescriptorBudget.for_limit(raise_limit())
        return _process
