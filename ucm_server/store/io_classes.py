"""I/O classes: work a request waits for goes before work nobody waits for, and both progress.

The daemon's disk, copy and shared-tier work runs in thread pools, and before it ran there first in,
first out: a Load a vLLM request was waiting for queued behind the copies of eight clients' dumps and
the write-back of a gigabyte backlog (``benchmarks/io_classes.py`` measured 2-4x its idle latency).
Work now carries a class:

* :attr:`IoClass.LOAD` — a request is waiting (Load tasks, lookups' rare disk work, the byte RPCs);
* :attr:`IoClass.PREFETCH` — a request may wait (prefetch and its promotions);
* :attr:`IoClass.BACKGROUND` — nobody waits (dumps, write-back).

The class is a context variable, set once where the work starts (a task by its kind, the write-back
flushers) and read where work is handed to a pool: :class:`ClassedExecutor` reads it in ``submit``,
which ``loop.run_in_executor`` calls in the submitting task's context, so every tier's executor hop
inherits its request's class without a parameter threaded through the tier interface.

:class:`ClassedExecutor` is a thread pool with one queue per class. A free thread takes the oldest job
of the highest class that has room, where room is:

* LOAD: fewer than ``max_workers`` loads running;
* each lower class: the classes above it and it together hold fewer than ``max_workers`` plus one
  thread per class below LOAD down to it. The pool has two threads more than ``max_workers``, so
  PREFETCH keeps one thread no load can take and BACKGROUND one that neither can: however steady the
  stream of loads, background work progresses (no starvation), and a load never waits in a queue
  behind a job of a lower class — only, at worst, for running ones to end;
* lower classes are also capped below ``max_workers`` (``reserve`` threads stay free for loads to
  arrive), and while loads are queued or running BACKGROUND is held to one job: a load shares the
  disk with one background job at most.

Background work already running yields to loads at a finer grain than a job: between the units
of a job (a block written, a ``syncfs``, a few MiB copied) it calls :func:`yield_to_loads`, which
holds it while loads are queued or running in its pool (and :data:`LOAD_LINGER_S` after the last
one ended: the gap between a load's read and its copy). Traced in ``benchmarks/io_classes.py`` on
2 cores: a 16-block Load's disk reads took 1.4x their idle time when they overlapped the 8 MiB
background writes already running when it came (not queueing: its jobs waited under 1 ms in the
pool); held between blocks, those writes left the reads at 1.1x. The hold is bounded
(``background_hold_s``, :data:`BACKGROUND_HOLD_S` by default): while loads keep coming, one held
job goes on for one unit per bound, so background work still progresses (and a load that waits,
through a lock, for a held job waits that long at most). :class:`ClassedSlots`
applies the same rules to the daemon's task slots, so a Load task never waits for a slot behind
queued dumps.

Background jobs run on threads of their own, which lower their CPU and I/O priority for good when
they start (:mod:`~ucm_server.store.thread_priority`); loads and prefetch run on the others, so a
load never runs deprioritised. Traced per thread on 2 cores shared with other work, the slowest
busy probes were not queued in a pool: their read thread and the event loop sat runnable in the
CPU's run queue (100-270 ms of a 270-340 ms Load) while background threads copied and wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor, Future
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from ucm_server.store.thread_priority import lower_current_thread

P = ParamSpec("P")
T = TypeVar("T")


class IoClass(enum.IntEnum):
    """Lower value, higher priority."""

    LOAD = 0
    """A request is waiting for it."""
    PREFETCH = 1
    """A request may wait for it."""
    BACKGROUND = 2
    """Nobody waits for it (dumps, write-back)."""


CLASSES = tuple(IoClass)
_FOREGROUND = (IoClass.LOAD, IoClass.PREFETCH)
_BACKGROUND = (IoClass.BACKGROUND,)
current_class: ContextVar[IoClass] = ContextVar("ucm_io_class", default=IoClass.LOAD)
"""The class of the work the current task (or worker thread) does; unclassified work is LOAD, so
nothing is demoted by being forgotten."""

BACKGROUND_HOLD_S = 0.025
"""Default of the longest a held background job waits (:func:`yield_to_loads`) while loads keep
running: at least one background unit goes on per this many seconds. Long enough for a typical
Load from disk (16 MiB: 15-30 ms here) to run alone, short enough that write-back keeps draining
under a stream of loads."""
LOAD_LINGER_S = 0.002
"""Loads count as running this long after the last one's job ended: a Load's next job (its copy
after its read) follows within the event loop's turn, and background work resumed in the gap
would hold the disk when it comes."""

_BY_TASK_KIND = {"LOAD": IoClass.LOAD, "PREFETCH": IoClass.PREFETCH, "DUMP": IoClass.BACKGROUND}


def class_of_task(kind_name: str) -> IoClass:
    """The class of a daemon task by its kind's name (``LOAD``, ``DUMP``, ``PREFETCH``)."""
    return _BY_TASK_KIND.get(kind_name, IoClass.LOAD)


@contextlib.contextmanager
def io_class(cls: IoClass) -> Iterator[None]:
    """Work started in this block (and tasks created in it) is of class ``cls``."""
    token = current_class.set(cls)
    try:
        yield
    finally:
        current_class.reset(token)


_worker = threading.local()
"""In a :class:`ClassedExecutor` worker thread: ``pool``, the executor whose job runs on it."""


def may_yield() -> bool:
    """Whether :func:`yield_to_loads` may hold the work running here (worth cutting it finer)."""
    return current_class.get() is IoClass.BACKGROUND and getattr(_worker, "pool", None) is not None


def yield_to_loads() -> None:
    """A point where the background job running on this thread may be held for loads (see the
    module): call it between units of work, holding no lock a load may need. Elsewhere (outside a
    :class:`ClassedExecutor`, or in work of a higher class) it returns at once."""
    pool: ClassedExecutor | None = getattr(_worker, "pool", None)
    if pool is not None and current_class.get() is IoClass.BACKGROUND:
        pool.hold_background()


@dataclass(frozen=True, slots=True)
class Shares:
    """Who may take one more of ``limit`` places (threads, task slots), by class (see the module).

    The places are ``limit`` plus one per class below LOAD: the spare ones are floors only lower
    classes can reach. ``reserve``: places lower classes leave to loads (a quarter, at least one);
    ``background_when_loading``: most BACKGROUND holders while loads wait or run."""

    limit: int
    reserve: int = -1
    background_when_loading: int = 1

    def __post_init__(self) -> None:
        if self.limit <= 0:
            raise ValueError(f"the limit must be positive, got {self.limit}")
        if self.reserve < 0:
            object.__setattr__(self, "reserve", max(1, self.limit // 4))
        if self.reserve >= self.limit and self.limit > 1:
            raise ValueError(f"reserve must be in [0, {self.limit}), got {self.reserve}")

    @property
    def places(self) -> int:
        return self.limit + len(CLASSES) - 1

    def has_room(self, cls: IoClass, held: dict[IoClass, int], loading: bool) -> bool:
        """Whether one more holder of ``cls`` fits, ``held`` holding per class now."""
        if sum(held.values()) >= self.places:
            return False
        if sum(held[c] for c in CLASSES[: cls + 1]) >= self.limit + cls:  # the floors below stay free
            return False
        if cls is IoClass.LOAD:
            return True
        if cls is IoClass.BACKGROUND and loading:
            return held[cls] < self.background_when_loading
        return held[cls] < max(1, self.limit - self.reserve)


@dataclass(slots=True)
class ClassFigures:
    """What one class did in a pool (counters since start)."""

    submitted: int = 0
    completed: int = 0
    queued: int = 0
    running: int = 0
    wait_s: float = 0.0
    """Seconds its jobs spent queued, all together."""


@dataclass(slots=True)
class _Job:
    future: Future[Any]
    fn: Callable[[], Any]
    cls: IoClass
    queued_at: float = field(default=0.0)


class ClassedExecutor(Executor):
    """A thread pool that runs LOAD before PREFETCH before BACKGROUND work (see the module): up to
    ``max_workers`` threads for loads, two more for the lower classes' floors.

    ``reserve``: threads lower classes leave to loads (default a quarter, at least one);
    ``background_when_loading``: the most BACKGROUND jobs that run while loads are queued or running;
    ``background_hold_s``: the longest a background job is held mid-job for loads before one goes on
    (:func:`yield_to_loads`; 0: never held mid-job)."""

    def __init__(
        self,
        max_workers: int,
        *,
        thread_name_prefix: str = "ucm-io",
        reserve: int | None = None,
        background_when_loading: int = 1,
        background_hold_s: float = BACKGROUND_HOLD_S,
    ) -> None:
        if max_workers <= 0:
            raise ValueError(f"max_workers must be positive, got {max_workers}")
        self.max_workers = max_workers
        self.shares = Shares(max_workers, -1 if reserve is None else reserve, max(1, background_when_loading))
        self._prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._queues: dict[IoClass, deque[_Job]] = {c: deque() for c in CLASSES}
        self._running: dict[IoClass, int] = dict.fromkeys(CLASSES, 0)
        self._figures: dict[IoClass, ClassFigures] = {c: ClassFigures() for c in CLASSES}
        self._threads: list[threading.Thread] = []
        self._ready_for = {False: threading.Condition(self._lock), True: threading.Condition(self._lock)}
        """By kind of thread (True: background): where its idle threads wait for work."""
        self._started = {False: 0, True: 0}
        self._most = {False: self.shares.places - 1, True: max(1, self.shares.limit - self.shares.reserve)}
        """Threads of each kind at most: loads and prefetch (``max_workers`` and the PREFETCH
        floor), background work (its cap: it never holds more places)."""
        self._idle = {False: 0, True: 0}
        self._wakeups = {False: 0, True: 0}
        """Idle threads told to look for work that have not woken yet: an idle thread is counted once."""
        self._shutdown = False
        self._loads_left = threading.Condition(self._lock)
        """Notified when the last queued or running load ends: held background jobs look again."""
        self._load_ended = -LOAD_LINGER_S
        self._background_moved = 0.0
        """When a background job last went on past :meth:`hold_background` (or started)."""
        self._held = 0
        self.background_hold_s = background_hold_s

    # -- Executor ----------------------------------------------------------------------------------
    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Queue ``fn(*args, **kwargs)`` in the class of the calling context."""
        return self.submit_as(current_class.get(), fn, *args, **kwargs)

    def submit_as(self, cls: IoClass, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        job = _Job(future, (lambda: fn(*args, **kwargs)) if args or kwargs else fn, cls)
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            job.queued_at = _now()
            self._queues[cls].append(job)
            self._figures[cls].submitted += 1
            background = cls is IoClass.BACKGROUND
            if self._idle[background] > self._wakeups[background]:
                self._wakeups[background] += 1
                self._ready_for[background].notify()
            elif self._started[background] < self._most[background]:
                self._start_thread(background)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                for queue in self._queues.values():
                    while queue:
                        queue.popleft().future.cancel()
            for ready in self._ready_for.values():
                ready.notify_all()
            self._loads_left.notify_all()
        if wait:
            for t in list(self._threads):
                t.join()

    # -- figures -----------------------------------------------------------------------------------
    def figures(self) -> dict[IoClass, ClassFigures]:
        """Per class: jobs submitted, completed, queued and running now, seconds spent queued."""
        with self._lock:
            out = {}
            for c, f in self._figures.items():
                out[c] = ClassFigures(
                    f.submitted, f.completed, len(self._queues[c]), self._running[c], f.wait_s
                )
            return out

    # -- holding background work for loads -----------------------------------------------------------
    def _loading(self, now: float) -> bool:
        """Loads are queued or running, or the last one ended under :data:`LOAD_LINGER_S` ago."""
        load = IoClass.LOAD
        return bool(self._queues[load] or self._running[load] or now - self._load_ended < LOAD_LINGER_S)

    def hold_background(self) -> None:
        """Hold the calling background job while loads run (:func:`yield_to_loads`), at most until
        no background job has gone on for ``background_hold_s``: then this one goes on."""
        with self._lock:
            while True:
                now = _now()
                if not self._loading(now) or self._shutdown or not self.background_hold_s:
                    break
                due = self._background_moved + self.background_hold_s
                if now >= due:
                    break
                if not (self._queues[IoClass.LOAD] or self._running[IoClass.LOAD]):
                    due = min(due, self._load_ended + LOAD_LINGER_S)  # only lingering: look again then
                self._held += 1
                self._loads_left.wait(due - now)
                self._held -= 1
            self._background_moved = _now()

    @property
    def held_background(self) -> int:
        """Background jobs held for loads now."""
        with self._lock:
            return self._held

    # -- scheduling --------------------------------------------------------------------------------
    def _pick(self, background: bool) -> _Job | None:
        """The next job for a free thread of its kind (under the lock), or None when all that waits
        for that kind is capped."""
        loading = bool(self._queues[IoClass.LOAD] or self._running[IoClass.LOAD])
        for c in _BACKGROUND if background else _FOREGROUND:
            if self._queues[c] and self.shares.has_room(c, self._running, loading):
                return self._queues[c].popleft()
        return None

    def _waiting(self, background: bool) -> bool:
        return any(self._queues[c] for c in (_BACKGROUND if background else _FOREGROUND))

    def _start_thread(self, background: bool) -> None:
        kind = "bg" if background else "fg"
        name = f"{self._prefix}_{kind}{self._started[background]}"
        t = threading.Thread(target=self._work, args=(background,), name=name, daemon=True)
        self._threads.append(t)
        self._started[background] += 1
        t.start()

    def _work(self, background: bool) -> None:
        """A worker thread's life. A background one lowers its own priority first
        (:mod:`~ucm_server.store.thread_priority`) and, not allowed to raise it again, runs only
        BACKGROUND jobs; a foreground one never runs them, so a load never runs deprioritised."""
        _worker.pool = self
        if background:
            lower_current_thread()
        ready = self._ready_for[background]
        while True:
            with self._lock:
                job = self._pick(background)
                while job is None:
                    if self._shutdown and not self._waiting(background):
                        ready.notify_all()
                        return
                    self._idle[background] += 1
                    ready.wait()
                    self._idle[background] -= 1
                    self._wakeups[background] = max(self._wakeups[background] - 1, 0)
                    job = self._pick(background)
                self._running[job.cls] += 1
                self._figures[job.cls].wait_s += _now() - job.queued_at
                if job.cls is IoClass.BACKGROUND:
                    self._background_moved = max(self._background_moved, _now())
            deliver: Callable[[], object] | None = None
            try:
                if job.future.set_running_or_notify_cancel():
                    current_class.set(job.cls)  # this thread's context: what the job submits is its class
                    try:
                        result = job.fn()
                    except BaseException as exc:  # delivered to the waiter, as ThreadPoolExecutor does
                        deliver = functools.partial(job.future.set_exception, exc)
                    else:
                        deliver = functools.partial(job.future.set_result, result)
                        del result
            finally:
                with self._lock:
                    self._running[job.cls] -= 1
                    self._figures[job.cls].completed += 1
                    if job.cls is IoClass.LOAD and not self._running[job.cls] and not self._queues[job.cls]:
                        self._load_ended = _now()
                        self._loads_left.notify_all()
                    # A capped job may run now (a load ended), and an idle thread may take it.
                    for kind, idle in self._ready_for.items():
                        if self._waiting(kind):
                            idle.notify_all()
            # Delivered once counted: whoever has the result reads figures that include its job.
            if deliver is not None:
                deliver()
            del job, deliver


class ClassedSlots:
    """Task slots shared by class as :class:`ClassedExecutor` shares threads (:class:`Shares`): up to
    ``limit`` Loads hold one at once, and two more slots are floors for the lower classes. A freed
    slot goes to the highest class waiting that has room. On the event loop thread only (no lock)."""

    def __init__(self, limit: int) -> None:
        self.shares = Shares(limit)
        self._held: dict[IoClass, int] = dict.fromkeys(CLASSES, 0)
        self._waiters: dict[IoClass, deque[asyncio.Future[None]]] = {c: deque() for c in CLASSES}

    @property
    def held(self) -> int:
        return sum(self._held.values())

    @contextlib.asynccontextmanager
    async def hold(self, cls: IoClass | None = None) -> AsyncIterator[None]:
        """A slot for the duration of the block, in ``cls`` (default: the context's class)."""
        cls = current_class.get() if cls is None else cls
        await self._acquire(cls)
        try:
            yield
        finally:
            self._held[cls] -= 1
            self._grant()

    def _room(self, cls: IoClass) -> bool:
        loading = bool(self._held[IoClass.LOAD] or self._waiters[IoClass.LOAD])
        return self.shares.has_room(cls, self._held, loading)

    async def _acquire(self, cls: IoClass) -> None:
        if not self._waiters[cls] and self._room(cls):
            self._held[cls] += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[cls].append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():  # granted as we were cancelled: give it back
                self._held[cls] -= 1
                self._grant()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters[cls].remove(fut)
            raise

    def _grant(self) -> None:
        while True:
            cls = next((c for c in CLASSES if self._waiters[c] and self._room(c)), None)
            if cls is None:
                return
            fut = self._waiters[cls].popleft()
            if not fut.done():
                self._held[cls] += 1
                fut.set_result(None)


_now = time.monotonic
