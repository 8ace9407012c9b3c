"""The SGLang backend's settings: the keys of SGLang's ``--hicache-storage-backend-extra-config``.

SGLang hands the whole JSON object to the backend (``HiCacheStorageConfig.extra_config``), its own
keys included (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``...). Ours are
checked like the vLLM connector's: an unknown key or a bad value is a ``ConfigError`` naming the key,
raised while SGLang builds the backend, so a typo stops start-up instead of being ignored. The
environment (``UCM_SOCKET`` / ``UCM_TARGET``, ``UCM_TOKEN``) fills what the JSON leaves out, as
for every UCM client.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_type_hints

from ucm_client.vllm.retention import Retention, parse
from ucm_protocol.errors import ConfigError
from ucm_protocol.settings import load_fields

__all__ = ["SGLANG_KEYS", "ConfigError", "SGLangStorageConfig", "load_config"]

LOGGER_NAME = "sglang.ucm_storage"
"""Under SGLang's logger tree, so the backend's messages get SGLang's format and level."""

SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "allocator", "tp_lcm_size")
"""Keys of the extra config that SGLang itself reads (the backend leaves them to SGLang)."""

WHERE = "--hicache-storage-backend-extra-config"


@dataclass(frozen=True, slots=True)
class SGLangStorageConfig:
    """Everything the SGLang backend can be told. Each field's docstring says why it exists."""

    target: str | None = None
    """Daemon address: a socket path or ``unix:///path``. None: ``$UCM_SOCKET`` / ``$UCM_TARGET``,
    else the daemon's default socket, so a plain ``ucm-server`` beside SGLang just works. The host
    pool is shared with the daemon as memory, so the daemon must be local (a Unix socket)."""

    token: str | None = None
    """Bearer token of a tenant (default ``$UCM_TOKEN``): its namespace, quota and encryption key
    apply to SGLang's pages exactly as to vLLM's."""

    model_id: str | None = None
    """Replaces SGLang's model name in the namespace (e.g. a registry digest): two servers that name
    the same weights differently still share pages; two different checkpoints under one name never."""

    zero_copy: bool = True
    """Share SGLang's host KV pool itself with the daemon (the daemon copies straight into and out
    of the pages SGLang uses). Off, or when the pool cannot be shared (pinned for CUDA, or not its
    own mapping), pages go through a shared staging buffer: one extra copy each way."""

    staging_buffer_mib: int = 64
    """Size of each of the two staging buffers (one for reads, one for writes) used when the pool is
    not shared, and by the generic (non-``interface_v1``) path. Batches larger than it are moved in
    parts."""

    prefetch_on_lookup: bool = True
    """When ``batch_exists`` finds a prefix, ask the daemon to promote it into its Cache at once, so
    pages only on disk are read while SGLang allocates host memory for them."""

    load_timeout_s: float = 10.0
    """A read not done in this time is cancelled: its pages are reported missing (SGLang recomputes)."""

    save_timeout_s: float = 30.0
    """A write not done in this time is cancelled: its pages are reported not stored."""

    connect_timeout_s: float = 2.0
    """How long one connection attempt to the daemon may take."""

    rpc_timeout_s: float = 5.0
    """Longest one control call may take before the daemon counts as down (SGLang goes on without it)."""

    reconnect_interval_s: float = 5.0
    """After the daemon was found down, wait this long before trying again (not every call)."""

    retention: Mapping[str, Any] | None = None
    """``{"pin": bool, "ttl_s": seconds, "priority": -100..100}`` applied to every page this server
    stores (SGLang passes no per-request settings to its storage backend)."""

    wait_durable: bool = False
    """A write counts as done only once it reached a durable tier (slower; pages survive a daemon crash)."""


_HINTS = get_type_hints(SGLangStorageConfig)
_OPTIONAL_STRINGS = ("target", "token", "model_id")


def _settle(name: str, value: Any) -> Any:
    where = f"{WHERE}: {name}"
    if _HINTS[name] is float and value <= 0:
        raise ConfigError(f"{where}: expected a positive number of seconds, got {value!r}")
    if name == "staging_buffer_mib" and value <= 0:
        raise ConfigError(f"{where}: expected a positive number of MiB, got {value!r}")
    if name in _OPTIONAL_STRINGS:
        return value or None
    return value


def _check_target(target: str | None) -> None:
    """Refuse, at start-up, a target that can never work: the host pool is shared as memory, which
    only a local daemon on a Unix socket can map."""
    if target is None:
        return
    if target.startswith(("unix:", "/", ".", "~")):
        return
    raise ConfigError(
        f"{WHERE}: target {target!r} is not a Unix socket (a path or unix:///path): SGLang's host "
        "pool is shared with ucm-server as memory, which needs the daemon on this machine"
    )


def load_config(
    extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> tuple[SGLangStorageConfig, Retention | None]:
    """The backend's settings from SGLang's extra config (and the environment for what it leaves out),
    with the parsed retention; ``ConfigError`` naming the key at fault."""
    env = os.environ if environ is None else environ
    raw = dict(extra_config or {})
    values = load_fields(
        SGLangStorageConfig, raw, WHERE, source="structured", skip=SGLANG_KEYS, required=False
    )
    values = {k: _settle(k, v) for k, v in values.items()}
    if values.get("target") is None:
        values["target"] = env.get("UCM_TARGET") or env.get("UCM_SOCKET") or None
    config = SGLangStorageConfig(**values)
    _check_target(config.target)
    retention = None
    if config.retention is not None:
        try:
            retention = parse(config.retention)
        except ValueError as exc:
            raise ConfigError(f"{WHERE}: retention: {exc}") from None
    return config, retention


def config_fields() -> list[str]:
    """The keys this backend reads (for messages and docs)."""
    return [f.name for f in dataclasses.fields(SGLangStorageConfig)]
