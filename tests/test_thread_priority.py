"""Background work runs on threads of lower CPU and I/O priority, and loads never do.

What is checked is what the kernel reports for each thread (``/proc/self/task/<tid>/stat``'s nice
field, ``ioprio_get``), read from inside the jobs themselves, so a job that ran on the wrong kind
of thread, or a priority that was never applied, shows.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ucm_server.store.io_classes import ClassedExecutor, IoClass
from ucm_server.store.thread_priority import (
    BACKGROUND_IO_LEVEL,
    BACKGROUND_NICE,
    IOPRIO_CLASS_BEST_EFFORT,
    io_priority_of,
    lower_current_thread,
)

WAIT_S = 30
LINUX = Path("/proc/self/task").is_dir()


def _nice_of(tid: int) -> int:
    """The thread's nice value as the kernel reports it (field 19 of its ``stat``)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def _where() -> tuple[int, int, tuple[int, int] | None]:
    tid = threading.get_native_id()
    return tid, _nice_of(tid), io_priority_of(tid)


@pytest.mark.skipif(not LINUX, reason="per-thread priorities are read from Linux's /proc")
def test_background_jobs_run_on_lowered_threads_and_loads_never_do() -> None:
    base = _nice_of(threading.get_native_id())  # the test may itself run under `nice`
    pool = ClassedExecutor(2)
    try:
        jobs = []
        for _ in range(6):  # interleaved, so a thread that ran one class would be offered the other
            jobs.append((IoClass.BACKGROUND, pool.submit_as(IoClass.BACKGROUND, _where)))
            jobs.append((IoClass.LOAD, pool.submit_as(IoClass.LOAD, _where)))
            jobs.append((IoClass.PREFETCH, pool.submit_as(IoClass.PREFETCH, _where)))
        seen = [(cls, f.result(WAIT_S)) for cls, f in jobs]
    finally:
        pool.shutdown()
    background = {tid for cls, (tid, _, _) in seen if cls is IoClass.BACKGROUND}
    foreground = {tid for cls, (tid, _, _) in seen if cls is not IoClass.BACKGROUND}
    assert not background & foreground, "a thread ran both background work and a load"
    for cls, (_, nice, io) in seen:
        if cls is IoClass.BACKGROUND:
            assert nice == max(base, BACKGROUND_NICE)
            assert io in (None, (IOPRIO_CLASS_BEST_EFFORT, BACKGROUND_IO_LEVEL))  # None: no ioprio_get here
        else:
            assert nice == base, f"a {cls.name} job ran at nice {nice}"
            assert io is None or io[0] == 0 or io[1] < BACKGROUND_IO_LEVEL, f"a {cls.name} job ran at {io}"


@pytest.mark.skipif(not LINUX, reason="per-thread priorities are read from Linux's /proc")
def test_lowering_a_thread_never_raises_it_and_leaves_the_others_alone() -> None:
    base = _nice_of(threading.get_native_id())
    out: dict[str, int] = {}

    def nicer_already() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        lowered = lower_current_thread(BACKGROUND_NICE, io_low=False)
        out["nice"], out["ok"] = _nice_of(tid), int(lowered.nice)

    t = threading.Thread(target=nicer_already)
    t.start()
    t.join(WAIT_S)
    assert out == {"nice": 19, "ok": 1}
    assert _nice_of(threading.get_native_id()) == base  # only the calling thread changed
