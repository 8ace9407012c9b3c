"""Where the daemon's configuration comes from: defaults < YAML < ``UCM_*`` env < flags.

Unknown keys and bad values stop start-up with a :class:`ConfigError` that names the key and where it
came from; nothing is silently ignored. YAML may use the flat form (``store_pipeline: "Cache|Posix"``)
or the ``ucm_connectors`` form (``ucm_connectors: [{ucm_connector_name: ..., ucm_connector_config:
{...}}]``), whose first connector config is read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_type_hints

from ucm_protocol.errors import ConfigError
from ucm_protocol.settings import coerce, read_yaml_mapping
from ucm_server.config import ServerConfig
from ucm_server.server_settings import FIELDS

__all__ = ["describe", "load_config", "read_env", "read_yaml"]

# UCM_* variables read by clients or by other parts of the product, not by the daemon's config.
_CLIENT_ENV = {
    "UCM_CONFIG_FILE",
    "UCM_SERVER_CONFIG",  # which file --config defaults to (ucm_protocol.paths.SERVER_CONFIG_ENV)
    "UCM_LOG_LEVEL",
    "UCM_TOKEN",
    "UCM_TARGET",
    "UCM_CONNECTOR_STRICT",
    "UCM_EXIT_WITH_PARENT",
    "UCM_DAEMON_UID",
}
_HINTS = get_type_hints(ServerConfig)


def _coerce(key: str, raw: object, source: str) -> Any:
    """Turn a YAML/env/flag value into the field's type, naming key and source on failure."""
    where = f"{key} (from {source})"
    value = coerce(_HINTS[key], raw, where, size=bool(FIELDS[key].metadata.get("size")), source="text")
    if key == "tier_settings":
        bad = [k for k, v in value.items() if not isinstance(k, str) or not isinstance(v, dict)]
        if bad:
            raise ConfigError(f"{where}: expected tier name -> mapping of settings, got entry {bad[0]!r}")
    return value


def _from_mapping(values: Mapping[str, object], source: str) -> dict[str, Any]:
    for key in values:
        if key not in FIELDS:
            raise ConfigError(f"{source}: unknown key {key!r}; known: {', '.join(FIELDS)}")
    return {key: _coerce(key, raw, source) for key, raw in values.items()}


def read_yaml(path: Path) -> dict[str, Any]:
    doc = read_yaml_mapping(path, "config file")
    if "ucm_connectors" in doc:  # the ucm_connectors form: take the first connector's config
        connectors = doc["ucm_connectors"]
        if not isinstance(connectors, list) or not connectors or not isinstance(connectors[0], dict):
            raise ConfigError(f"config file {path}: ucm_connectors must be a non-empty list of mappings")
        inner = connectors[0].get("ucm_connector_config", {})
        if not isinstance(inner, dict):
            raise ConfigError(f"config file {path}: ucm_connector_config must be a mapping")
        return _from_mapping(inner, f"{path} (ucm_connectors[0].ucm_connector_config)")
    return _from_mapping(doc, str(path))


def read_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """Known ``UCM_*`` settings, and the names of unknown ``UCM_*`` variables (to warn about)."""
    out: dict[str, Any] = {}
    unknown: list[str] = []
    for name, raw in environ.items():
        if not name.startswith("UCM_") or name in _CLIENT_ENV:
            continue
        key = name[4:].lower()
        if key in FIELDS:
            out[key] = _coerce(key, raw, f"environment {name}")
        else:
            unknown.append(name)
    level = environ.get("UNIFIED_CACHE_LOG_LEVEL") or environ.get("UCM_LOG_LEVEL")
    if level:
        out["log_level"] = level
    return out, unknown


def load_config(
    config_file: Path | None = None,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[ServerConfig, list[str]]:
    """Defaults < YAML < env < ``overrides`` (command-line flags). Returns the config and warnings."""
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(read_yaml(config_file))
    env_values, unknown_env = read_env(os.environ if environ is None else environ)
    values.update(env_values)
    if overrides:
        values.update(_from_mapping({k: v for k, v in overrides.items() if v is not None}, "command line"))
    warnings = [f"ignoring unknown environment variable {n} (not a ucm-server setting)" for n in unknown_env]
    return ServerConfig(**values).validate(), warnings


def describe(config: ServerConfig) -> dict[str, Any]:
    """The effective configuration as plain data (``--print-config``)."""
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = getattr(config, name)
        out[name] = str(value) if isinstance(value, Path) else value
    return out
