"""The connector's hold on the daemon: connect lazily, survive its absence, say so once.

vLLM must keep serving when ``ucm-server`` is down, at start or mid-run: every call site asks
``DaemonLink.client()`` and gets None while the daemon is known to be down, so the connector
degrades to "no hits, no saves" (vLLM recomputes) instead of paying a connection timeout per step.
The first failure logs one warning; later attempts happen at most every ``reconnect_interval_s``;
recovery logs one line. The ``UcmClient`` itself re-registers memory regions after a reconnect, so
region handles taken once stay valid across daemon restarts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from ucm_client import UcmClient
from ucm_client.errors import DeadlineExceeded, UcmError, Unavailable
from ucm_client.vllm.config import LOGGER_NAME

__all__ = ["DaemonLink"]

logger = logging.getLogger(LOGGER_NAME)

# Targets this process has already warned about: the scheduler and worker halves share a process in
# single-process vLLM, and one outage deserves one warning, not one per role.
_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


class DaemonLink:
    """A ``UcmClient`` that is either usable or known to be down (with a retry time)."""

    def __init__(
        self,
        target: str | None,
        *,
        reconnect_interval_s: float,
        connect_timeout_s: float = 2.0,
        rpc_timeout_s: float = 10.0,
        on_connect: Callable[[UcmClient], None] | None = None,
        role: str = "connector",
        clock: Callable[[], float] = time.monotonic,
        engine: str = "vLLM",
        token: str | None = None,
    ) -> None:
        """``engine`` names the engine in messages and in the client name (``<engine>-<role>``);
        ``token``: the client's bearer token (default ``$UCM_TOKEN``)."""
        self._target = target
        self._interval = reconnect_interval_s
        self._timeouts = (connect_timeout_s, rpc_timeout_s)
        self._on_connect = on_connect
        self._role = role
        self._clock = clock
        self._engine = engine
        self._token = token
        self._client: UcmClient | None = None
        self._retry_at = 0.0
        self._down = False
        self._lock = threading.Lock()

    @property
    def is_down(self) -> bool:
        return self._down

    def client(self) -> UcmClient | None:
        """The connected client, or None while the daemon is down and the retry time not reached."""
        with self._lock:
            if self._down and self._clock() < self._retry_at:
                return None
            if self._client is None:
                client = UcmClient(
                    target=self._target,
                    client_name=f"{self._engine.lower()}-{self._role}",
                    connect_timeout_s=self._timeouts[0],
                    rpc_timeout_s=self._timeouts[1],
                    token=self._token,
                )
                try:
                    client.connect()
                    if self._on_connect is not None:
                        self._on_connect(client)
                except UcmError as exc:
                    client.close()
                    self._mark_down_locked(exc)
                    return None
                self._client = client
            if self._down:
                # A retry is due: hand the client out; the next call tells whether it is back.
                self._retry_at = self._clock() + self._interval
            return self._client

    def succeeded(self) -> None:
        """A call went through: if the daemon had been down, say it is back."""
        if self._down:
            with self._lock:
                if self._down:
                    self._down = False
                    with _WARNED_LOCK:
                        announce = self._where() in _WARNED
                        _WARNED.discard(self._where())
                    if announce:
                        logger.warning("UCM: daemon at %s is reachable again", self._where())

    def failed(self, exc: BaseException) -> bool:
        """Record a failed call; True if it means the daemon is down (vs. a per-call error).

        A call that ran out of time counts as down too: a hung daemon must not cost every request
        an ``rpc_timeout_s`` stall in vLLM's scheduler loop.
        """
        if not isinstance(exc, Unavailable | DeadlineExceeded):
            return False
        with self._lock:
            self._mark_down_locked(exc)
        return True

    def _mark_down_locked(self, exc: BaseException) -> None:
        self._retry_at = self._clock() + self._interval
        if not self._down:
            self._down = True
            with _WARNED_LOCK:
                first = self._where() not in _WARNED
                _WARNED.add(self._where())
            if first:
                logger.warning(
                    "UCM: daemon at %s is unavailable (%s); %s keeps serving without the external "
                    "KV cache (prefixes are recomputed) and retries every %g s",
                    self._where(),
                    exc,
                    self._engine,
                    self._interval,
                )

    def _where(self) -> str:
        return self._target or "the default socket"

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                with contextlib.suppress(UcmError):
                    self._client.close()
                self._client = None
