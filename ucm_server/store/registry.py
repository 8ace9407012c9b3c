"""Tier classes by name, imported lazily by module path, and the builder of one tier from its settings.

``BUILTIN_TIERS`` is the one list of built-in tiers (the daemon's help text and start-up check read
it from here). A backend with heavy or optional imports (Mooncake, boto3, hf3fs) costs nothing until a
pipeline names it. Out-of-tree tiers register through the ``ucm.tiers`` entry-point group
(``Name = "pkg.mod:Class"``) and are then usable in ``store_pipeline`` like the built-ins. Names are
unique: registering one twice is an error, and an unknown name is answered with the list of known ones.
Every tier is built by its :meth:`~ucm_server.store.base.Tier.from_settings`; the pipeline of them
is assembled in :mod:`ucm_server.store.assembly`. This module does not import the daemon's config,
so ``ucm_server.config`` can import the tier list from here.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Mapping
from importlib.metadata import entry_points
from types import MappingProxyType

from ucm_protocol.errors import ConfigError
from ucm_server.store.base import Tier, TierContext

BUILTIN_TIERS: Mapping[str, str] = MappingProxyType(
    {
        "Cache": "ucm_server.store.cache:CacheTier",
        "Posix": "ucm_server.store.posix:PosixTier",
        "DS3FS": "ucm_server.store.ds3fs:DS3FSTier",
        "Mooncake": "ucm_server.store.mooncake:MooncakeTier",
        "S3": "ucm_server.store.s3:S3Tier",
    }
)
"""The built-in tiers, fastest first, by ``store_pipeline`` name: the one list of them."""
_registry: dict[str, str] = dict(BUILTIN_TIERS)
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


def build_tier(name: str, settings: Mapping[str, object], context: TierContext) -> Tier:
    """The tier ``name`` of a pipeline, built by its class's ``from_settings``."""
    cls = tier_class(name)
    if _takes_context(cls):
        return cls.from_settings(name, settings, context)
    # A tier written before TierContext existed: ``from_settings(name, settings)``.
    warnings.warn(
        f"tier {name!r} ({cls.__module__}.{cls.__qualname__}): from_settings(name, settings) is "
        "deprecated; accept a third argument, context: TierContext",
        DeprecationWarning,
        stacklevel=2,
    )
    tier: Tier = cls.from_settings(name, settings)
    from ucm_server.store.posix import PosixTier

    if isinstance(tier, PosixTier):  # as before TierContext: file tiers learn the daemon's limit
        tier.max_block_bytes = context.max_block_bytes
    return tier


def _takes_context(cls: type[Tier]) -> bool:
    """Whether ``cls.from_settings`` accepts the context (every tier here does; old plugins may not)."""
    try:
        params = inspect.signature(cls.from_settings).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)
