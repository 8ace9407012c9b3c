"""Default locations shared by the daemon and its clients, so both agree with no configuration."""

from __future__ import annotations

import os
from pathlib import Path


def default_socket_path() -> Path:
    """``$UCM_SOCKET``, else ``$XDG_RUNTIME_DIR/ucm/ucm.sock``, else ``/tmp/ucm-<uid>/ucm.sock``."""
    if env := os.environ.get("UCM_SOCKET"):
        return Path(env)
    if runtime := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(runtime) / "ucm" / "ucm.sock"
    return Path(f"/tmp/ucm-{os.getuid()}") / "ucm.sock"


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
