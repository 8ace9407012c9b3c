"""Peer benchmarks: other KV-cache servers measured the way our daemon's benchmark measures UCM.

Each peer runs in its own environment (its dependencies clash with ours), so this package only
holds thin runners that start the peer's script in a subprocess and parse the JSON it prints;
importing it never imports the peer. The runner is loaded lazily so that
``python -m benchmarks.peers.lmcache`` does not import its own module twice.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_lmcache_peer"]


def __getattr__(name: str) -> Any:
    if name == "run_lmcache_peer":
        from .lmcache import run_lmcache_peer

        return run_lmcache_peer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
