"""The local data plane: Lookup from a shared table and Load/Dump through a shared ring, without gRPC.

:class:`~ucm_server.dataplane.service.DataPlane` is the daemon's side; the layouts are in
:mod:`ucm_protocol.dataplane`, the client's side in :mod:`ucm_client.dataplane`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ucm_protocol.dataplane import dataplane_socket_path
from ucm_protocol.native import MISSING, native

if TYPE_CHECKING:
    from ucm_server.auth import Authenticator
    from ucm_server.config import ServerConfig
    from ucm_server.dataplane.service import DataPlane
    from ucm_server.engine import Engine

log = logging.getLogger(__name__)


def make_dataplane(
    config: ServerConfig, engine: Engine, authenticator: Authenticator | None
) -> DataPlane | None:
    """The daemon's data plane, or None when it is off (``dataplane: false``) or cannot run here."""
    if not config.dataplane:
        return None
    if native is None:
        log.warning("data plane off: %s; local clients use gRPC", MISSING)
        return None
    from ucm_server.dataplane.service import DataPlane

    return DataPlane(engine, authenticator, dataplane_socket_path(config.socket), config.dataplane_ring_bytes)
