"""Prefetch the scheduler starts: a hit found only in a lower tier starts moving into the Cache at once.

The scheduler's lookup runs a step (or, with ``load_async`` or a request waiting for memory, many
steps) before the worker's load. When the stored prefix is only on Posix or a shared tier, the load
would read it from there; a ``Prefetch`` submitted right after the lookup lets the daemon start
promoting it into its Cache meanwhile, and a load that arrives while the promotion runs waits for it
and reads memory instead of reading the disk again (``ucm_server.store.promotion``). Blocks already
in the Cache cost the daemon one in-memory lookup. The task is not waited for: a prefetch that fails
changes nothing (the load reads the lower tier itself). Nor is its answer: the ``Prefetch`` is sent
without waiting for the round trip (``prefetch_nowait``), which cost the scheduler about a millisecond
per request on the path to the first token, own prefix-cache hits included.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future

from ucm_client import UcmClient
from ucm_client.errors import UcmError
from ucm_client.vllm.config import LOGGER_NAME

__all__ = ["start_prefetch"]

logger = logging.getLogger(LOGGER_NAME)


def start_prefetch(client: UcmClient, namespaces: Sequence[bytes], keys: Sequence[bytes]) -> int:
    """Send one ``Prefetch`` of ``keys`` per namespace (TP rank), not waiting for the answers;
    returns how many were sent. A refused one (e.g. the session's task limit) is logged at debug."""
    submitted = 0
    for namespace in namespaces:
        try:
            client.prefetch_nowait(namespace, keys).add_done_callback(_log_refusal)
        except UcmError as exc:  # the client is closed: the load reads the lower tier itself
            logger.debug("UCM scheduler: prefetch not submitted: %s", exc)
            break
        submitted += 1
    return submitted


def _log_refusal(future: Future[int]) -> None:
    exc = future.exception() if not future.cancelled() else None
    if exc is not None:
        logger.debug("UCM scheduler: prefetch not submitted: %s", exc)
