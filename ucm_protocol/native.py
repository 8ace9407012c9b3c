"""The compiled helper, when it was built: ``native`` is the module, or None with ``MISSING`` saying why.

The helper (``ucm_protocol/csrc/``, built by ``setup.py`` at ``pip install``) carries the local
data plane's loops. Without it, nothing breaks: clients use gRPC for Lookup, Load and Dump as they
always could, and the daemon publishes no tables. ``UCM_DATAPLANE=off`` turns the data plane off
even where the helper is present (both daemon and client read it).
"""

from __future__ import annotations

import os

__all__ = ["DATAPLANE_ENV", "MISSING", "dataplane_enabled", "native"]

DATAPLANE_ENV = "UCM_DATAPLANE"

MISSING = ""
try:
    from ucm_protocol import _native as native
except ImportError as exc:  # no compiler at install time: the gRPC paths serve everything
    native = None  # type: ignore[assignment]  # callers test for None first
    MISSING = (
        f"the compiled helper ucm_protocol._native is not built ({exc}); install gcc and the Python "
        "headers (Debian: apt-get install gcc python3-dev) and reinstall UCM"
    )


def dataplane_enabled() -> bool:
    """Whether this process may use the local data plane (the helper is built and not turned off)."""
    if native is None:
        return False
    return os.environ.get(DATAPLANE_ENV, "on").strip().lower() not in ("0", "off", "false", "no")
