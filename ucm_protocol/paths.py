"""Default locations shared by the daemon and its clients, so both agree with no configuration."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ucm_protocol.errors import ConfigError
from ucm_protocol.settings import read_yaml_mapping

SOCKET_ENV = "UCM_SOCKET"
SERVER_CONFIG_ENV = "UCM_SERVER_CONFIG"
"""The daemon's config file when no ``--config`` is given, read by ``ucm-server`` and ``ucm-admin``
alike (the image sets it), so the admin tool finds the socket the daemon listens on with no flag.
It names a file, it is no setting: the file's settings still lose to ``UCM_*`` settings variables."""


def server_config_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """``$UCM_SERVER_CONFIG`` (``~`` expanded), or None."""
    value = (os.environ if environ is None else environ).get(SERVER_CONFIG_ENV)
    return Path(os.path.expanduser(value)) if value else None


def default_socket_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$UCM_SOCKET``, else ``$XDG_RUNTIME_DIR/ucm/ucm.sock``, else ``/tmp/ucm-<uid>/ucm.sock``."""
    env = os.environ if environ is None else environ
    if value := env.get(SOCKET_ENV):
        return Path(value)
    if runtime := env.get("XDG_RUNTIME_DIR"):
        return Path(runtime) / "ucm" / "ucm.sock"
    return Path(f"/tmp/ucm-{os.getuid()}") / "ucm.sock"


def socket_from_config(path: Path, environ: Mapping[str, str] | None = None) -> Path:
    """The socket ``ucm-server --config path`` listens on when started with ``environ``.

    Resolved as the daemon resolves it: the file's ``socket`` (flat form, or the seed form's
    ``ucm_connectors[0].ucm_connector_config``) < ``$UCM_SOCKET`` < the default path, ``~`` expanded
    for set values. Only ``socket`` is read, so a client needs none of the daemon's settings code; the
    daemon itself still rejects every other bad key at start. Raises :class:`ConfigError` naming the
    file when it is missing, unreadable, not YAML, or not shaped like a daemon config.
    """
    env = os.environ if environ is None else environ
    settings = _daemon_settings(path)
    if SOCKET_ENV in env:
        return Path(os.path.expanduser(env[SOCKET_ENV]))
    if "socket" in settings:
        return Path(os.path.expanduser(str(settings["socket"])))
    return default_socket_path(env)


def _daemon_settings(path: Path) -> dict[Any, Any]:
    """The settings mapping of a daemon config file (either form), with the daemon's error messages
    (read by the daemon's own reader: the same size cap and the same messages)."""
    doc = read_yaml_mapping(path)
    if "ucm_connectors" not in doc:
        return doc
    connectors = doc["ucm_connectors"]  # seed 001 form: the first connector's config
    if not isinstance(connectors, list) or not connectors or not isinstance(connectors[0], dict):
        raise ConfigError(f"config file {path}: ucm_connectors must be a non-empty list of mappings")
    inner = connectors[0].get("ucm_connector_config", {})
    if not isinstance(inner, dict):
        raise ConfigError(f"config file {path}: ucm_connector_config must be a mapping")
    return inner


def default_data_dir() -> Path:
    """``$XDG_STATE_HOME/ucm``, else ``~/.local/state/ucm``: where the Posix tier keeps blocks."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "ucm"


def target_for(socket_or_address: str | os.PathLike[str] | None) -> str:
    """A gRPC target from a socket path, ``unix:`` URI or ``host:port`` (None = default socket)."""
    if socket_or_address is None:
        return f"unix://{default_socket_path()}"
    text = os.fspath(socket_or_address)
    if text.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return text
    if text.startswith("/") or text.startswith("."):
        return f"unix://{Path(text).absolute()}"
    return text
