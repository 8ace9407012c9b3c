"""Per-request retention through vLLM's ``kv_transfer_params``: the ``ucm`` entry.

A request may ask the daemon to keep its prefix::

    {"kv_transfer_params": {"ucm": {"pin": true, "ttl_s": 3600, "priority": 10}}}

``pin`` (bool): never evicted until unpinned (``ucm-admin unpin``); ``ttl_s`` (seconds > 0): removed
from every tier that long after the request ends; ``priority`` (-100..100, default 0): lower is
evicted first; ``store`` (bool, default true): false saves none of the request's blocks (a one-off
prompt: nothing to evict shared prefixes or wear the disk; its hits still load). Any subset may be
given. The scheduler half applies it, once per TP rank's namespace,
to the request's blocks when they are stored: at ``request_finished`` for a request with nothing
to save (or whose saves the workers already reported), after the workers report its saves done
otherwise (``update_connector_output``), and at shutdown for saves never reported. A bad
entry is logged once and ignored: a request is never failed for its retention (nor is a retention
the daemon refuses, e.g. a pin past the tenant's quota: logged).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ucm_client.vllm.config import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

ENTRY = "ucm"
_KNOWN = ("pin", "ttl_s", "priority", "store")


@dataclass(frozen=True, slots=True)
class Retention:
    """What a request asked; ``None`` leaves that part to the daemon's default."""

    pin: bool | None = None
    ttl_s: float | None = None
    priority: int | None = None
    store: bool | None = None
    """False: none of the request's blocks is saved."""

    @property
    def retains(self) -> bool:
        """Whether it asks the daemon anything of stored blocks (pin, TTL or priority)."""
        return self.pin is not None or self.ttl_s is not None or self.priority is not None


def retention_of(request: Any) -> Retention | None:
    """The request's ``ucm`` entry, checked; ``None`` when it has none or it is malformed (logged)."""
    params = getattr(request, "kv_transfer_params", None)
    entry = params.get(ENTRY) if isinstance(params, Mapping) else None
    if entry is None:
        return None
    rid = getattr(request, "request_id", "?")
    try:
        return parse(entry)
    except ValueError as exc:
        logger.warning("UCM: request %s: kv_transfer_params[%r] ignored: %s", rid, ENTRY, exc)
        return None


def parse(entry: object) -> Retention | None:
    """``entry`` as a :class:`Retention` (``None`` when it asks nothing); ``ValueError`` naming the
    key at fault otherwise."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"must be a mapping of {', '.join(_KNOWN)}, got {type(entry).__name__}")
    unknown = sorted(str(k) for k in entry if k not in _KNOWN)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(_KNOWN)}")
    pin, ttl_s, priority = entry.get("pin"), entry.get("ttl_s"), entry.get("priority")
    if pin is not None and not isinstance(pin, bool):
        raise ValueError(f"'pin' must be true or false, got {pin!r}")
    if ttl_s is not None:
        if (
            isinstance(ttl_s, bool)
            or not isinstance(ttl_s, int | float)
            or not math.isfinite(ttl_s)
            or ttl_s <= 0
        ):
            raise ValueError(f"'ttl_s' must be a number of seconds > 0, got {ttl_s!r}")
        ttl_s = float(ttl_s)
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not -100 <= priority <= 100
    ):
        raise ValueError(f"'priority' must be an integer from -100 to 100, got {priority!r}")
    store = entry.get("store")
    if store is not None and not isinstance(store, bool):
        raise ValueError(f"'store' must be true or false, got {store!r}")
    if pin is None and ttl_s is None and priority is None and store is None:
        return None
    return Retention(pin, ttl_s, priority, store)
