"""Lowering the calling thread's CPU and I/O priority, for threads that only do background work.

On a node whose CPUs are shared (two cores here: the event loop, eight dumping clients and the
daemon's own write-back and copy threads), a Load's disk thread and the event loop spent most of
their tail time runnable but not running (``benchmarks/io_classes.py``, traced per thread from
``/proc/self/task/<tid>/schedstat``): on a loaded machine the slowest busy probes waited
100-270 ms in the run queue while background threads copied and wrote beside other processes; on a
quieter one the tail was disk time instead. Holding background jobs between their units
(:mod:`ucm_server.store.io_classes`) does not help there: the threads holding the CPU are mid-unit,
not queued. So the threads that run background work run at a lower priority for good:

* CPU: ``nice`` :data:`BACKGROUND_NICE` for the thread alone (Linux's nice is per thread:
  ``setpriority(PRIO_PROCESS, tid)``); threads the thread starts (the compiled copy helper's) inherit
  it. A higher nice is always allowed, a lower one needs privilege, so such a thread never goes back
  to foreground work.
* I/O: ``ioprio_set`` best effort, level 7 (the lowest of the class): BFQ gives the thread's
  requests the smallest share beside a Load's. Not the idle class: mq-deadline and BFQ serve an idle
  request only when nothing else waits (mq-deadline after 10 s of aging), so under a steady stream
  of loads a write-back ``fsync`` and every client's ``wait_durable`` would wait that long.

Both are best effort: on a kernel or sandbox that refuses a call the thread keeps its priority,
the refusal is logged once, and the daemon works as before (only less fair to loads).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

BACKGROUND_NICE = 10
"""The nice value of a background thread: CFS then gives a nice-0 thread (a Load's, the event
loop) about nine times its CPU share when both are runnable, while background work still runs
whenever a CPU has room (nice 19, SCHED_IDLE: so little that a background thread holding the GIL
when preempted could stall the loop behind it)."""

IOPRIO_CLASS_BEST_EFFORT = 2
BACKGROUND_IO_LEVEL = 7
"""The best-effort class's lowest level (0 is the highest)."""
_IOPRIO_CLASS_SHIFT = 13
_IOPRIO_WHO_PROCESS = 1  # a thread id names the thread alone
_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "ppc64le": (273, 274), "s390x": (282, 283)}
"""``(ioprio_set, ioprio_get)`` system call numbers by machine."""

_warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class Lowered:
    """What :func:`lower_current_thread` achieved (False where the system refused it)."""

    nice: bool
    io_low: bool


def _syscall_numbers() -> tuple[int, int] | None:
    return _SYSCALLS.get(platform.machine()) if platform.system() == "Linux" else None


@functools.cache
def _libc_syscall() -> Callable[..., int] | None:
    """libc's ``syscall`` (Python has no binding for ``ioprio_set``), None where there is none."""
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    syscall: Callable[..., int] = call
    return syscall


def lower_current_thread(nice: int = BACKGROUND_NICE, io_low: bool = True) -> Lowered:
    """Lower the calling thread's CPU priority to ``nice`` (never raise it: a thread already nicer
    stays so) and, with ``io_low``, its I/O priority to :data:`BACKGROUND_IO_LEVEL`; best effort."""
    tid = threading.get_native_id()
    niced = False
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        niced = True
    except (OSError, AttributeError) as exc:
        _warn_once("nice", f"background threads keep their CPU priority ({exc})")
    low = False
    if io_low:
        low = _set_io_low(tid)
    return Lowered(niced, low)


def _set_io_low(tid: int) -> bool:
    numbers, call = _syscall_numbers(), _libc_syscall()
    if numbers is None or call is None:
        _warn_once("ioprio", "background threads keep their I/O priority (no ioprio_set here)")
        return False
    value = IOPRIO_CLASS_BEST_EFFORT << _IOPRIO_CLASS_SHIFT | BACKGROUND_IO_LEVEL
    if call(ctypes.c_long(numbers[0]), _IOPRIO_WHO_PROCESS, tid, value) != 0:
        err = ctypes.get_errno()
        _warn_once("ioprio", f"background threads keep their I/O priority ({os.strerror(err)})")
        return False
    return True


def io_priority_of(tid: int) -> tuple[int, int] | None:
    """The I/O priority class and level of thread ``tid`` (class 0: none set), None where unknown."""
    numbers, call = _syscall_numbers(), _libc_syscall()
    if numbers is None or call is None:
        return None
    got = call(ctypes.c_long(numbers[1]), _IOPRIO_WHO_PROCESS, tid)
    return None if got < 0 else (int(got) >> _IOPRIO_CLASS_SHIFT, int(got) & ((1 << _IOPRIO_CLASS_SHIFT) - 1))


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("%s", message)
