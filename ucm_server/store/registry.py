"""Tier classes by name, imported lazily by module path, and the builder of a pipeline from config.

A backend with heavy or optional imports (Mooncake, boto3, hf3fs) costs nothing until a pipeline names
it. Out-of-tree tiers register through the ``ucm.tiers`` entry-point group (``Name = "pkg.mod:Class"``)
and are then usable in ``store_pipeline`` like the built-ins. Names are unique: registering one twice is
an error, and an unknown name is answered with the list of known ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from concurrent.futures import Executor
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from ucm_server.api.errors import ConfigError
from ucm_server.store.base import Tier
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.staging import StagingPool

if TYPE_CHECKING:
    from ucm_server.config import ServerConfig

_BUILTIN: dict[str, str] = {
    "Cache": "ucm_server.store.cache:CacheTier",
    "Posix": "ucm_server.store.posix:PosixTier",
    "DS3FS": "ucm_server.store.ds3fs:DS3FSTier",
    "Mooncake": "ucm_server.store.mooncake:MooncakeTier",
    "S3": "ucm_server.store.s3:S3Tier",
}
_registry: dict[str, str] = dict(_BUILTIN)
_plugins_loaded = False


def register_tier(name: str, target: str) -> None:
    """Make ``name`` usable in ``store_pipeline``; ``target`` is ``"package.module:Class"``."""
    if name in _registry:
        raise ValueError(f"tier {name!r} is already registered as {_registry[name]}")
    _registry[name] = target


def known_tiers() -> list[str]:
    _load_plugins()
    return sorted(_registry)


def tier_class(name: str) -> type[Tier]:
    _load_plugins()
    target = _registry.get(name) or (name if ":" in name else None)  # "package.module:Class" works too
    if target is None:
        raise ConfigError(f"unknown tier {name!r}; known tiers: {', '.join(sorted(_registry))}")
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"tier {name!r} ({target}) cannot be loaded: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise ConfigError(f"tier {name!r} ({target}) is not a Tier subclass")
    return cls


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group="ucm.tiers"):
        if ep.name not in _registry:
            _registry[ep.name] = ep.value


def build_tier(name: str, config: ServerConfig, executor: Executor) -> Tier:
    settings: Mapping[str, Any] = config.tier_settings.get(name, {})
    if name == "Cache":
        from ucm_server.store.cache import CacheTier

        return CacheTier(
            capacity=config.cache_capacity,
            page_size=config.cache_page_size,
            executor=executor,
            prefault=config.cache_prefault,
        )
    if name == "Posix":
        from ucm_server.store.posix import PosixTier

        return PosixTier(
            roots=config.posix_roots,
            capacity=config.posix_capacity,
            durable=config.durable,
            direct_io=config.posix_direct_io,
            executor=executor,
            max_block_bytes=config.max_block_bytes,
        )
    cls = tier_class(name)
    from_settings = getattr(cls, "from_settings", None)
    if from_settings is None:
        raise ConfigError(f"tier {name!r} cannot be built from configuration (no from_settings)")
    tier: Tier = from_settings(name, settings)
    from ucm_server.store.posix import PosixTier

    if isinstance(tier, PosixTier):  # DS3FS and other file tiers: headers above it are corrupt
        tier.max_block_bytes = config.max_block_bytes
    return tier


def build_pipeline(config: ServerConfig, executor: Executor) -> Pipeline:
    tiers = [build_tier(name, config, executor) for name in config.tiers]
    return Pipeline(
        tiers,
        write_back=config.write_mode == "write-back",
        flushers=max(2, config.io_threads // 2),
        shared_lookup_ttl_s=config.shared_lookup_ttl_s,
        staging=StagingPool(config.staging_bytes),
        executor=executor,
    )
