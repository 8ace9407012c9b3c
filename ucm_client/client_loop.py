"""The one event loop, in one thread, that every blocking :class:`~ucm_client.sync.UcmClient` of a
process runs on.

gRPC's asyncio layer has one completion queue per process. An event for a call of loop A that
arrives while loop B polls the queue is handed to A with ``call_soon_threadsafe``; if A was closed
by then (a client that closed its own private loop a moment before), B's loop prints an
"Exception in callback ... Event loop is closed" traceback. A client cannot know when gRPC has
delivered its last event, so the loop is never closed while the process lives: clients share it,
closing a client ends its calls and channel, and the loop is stopped once, at exit, after the
clients still open are closed and every task on it has ended (no "Task was destroyed but it is
pending" either). A forked child starts a loop of its own on first use (the parent's thread did not
survive the fork).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
import weakref
from typing import Any

THREAD_NAME = "ucm-client-loop"
_EXIT_WAIT_S = 5.0

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pid = 0
_at_exit: weakref.WeakSet[Any] = weakref.WeakSet()


def shared_loop() -> asyncio.AbstractEventLoop:
    """The process's client loop, started in a daemon thread on first use."""
    global _loop, _thread, _pid
    with _lock:
        if _loop is None or _pid != os.getpid() or _thread is None or not _thread.is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name=THREAD_NAME, daemon=True)
            thread.start()
            if _pid == 0:
                atexit.register(_stop_at_exit)
            _loop, _thread, _pid = loop, thread, os.getpid()
        return _loop


def close_at_exit(client: Any) -> None:
    """Call ``client.close()`` at exit if the client (weakly held) still lives then, before the loop
    stops."""
    _at_exit.add(client)


def _stop_at_exit() -> None:
    """Close the clients still open, end every task on the loop, stop and close it."""
    global _loop
    loop, thread = _loop, _thread
    if loop is None or thread is None or _pid != os.getpid() or not thread.is_alive():
        return
    for client in list(_at_exit):
        with contextlib.suppress(Exception):
            client.close()
    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(_end_tasks(), loop).result(_EXIT_WAIT_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(_EXIT_WAIT_S)
    if not thread.is_alive():
        loop.close()
        _loop = None


async def _end_tasks() -> None:
    """Cancel and reap what is left on the loop (a gRPC status handler can outlive its channel by a
    moment), as ``asyncio.run`` does."""
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in leftover:
        task.cancel()
    await asyncio.gather(*leftover, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()
