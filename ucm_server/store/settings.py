"""Validation of a tier's ``tier_settings`` entry, shared by every tier built from settings.

Each tier declares its settings as ``{name: type}``; values from YAML or the environment are coerced
(sizes like ``"256MiB"`` for ints, ``"true"``/``"false"`` for bools) and any unknown key or bad value
stops start-up with a :class:`ConfigError` naming the tier and the key — and never echoing the value of
a secret.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

from ucm_server.api.errors import ConfigError
from ucm_server.config import parse_size


def check_settings(
    kind: str,
    name: str,
    settings: Mapping[str, object],
    fields: Mapping[str, type],
    *,
    secrets: Collection[str] = (),
    required: Collection[str] = (),
) -> dict[str, Any]:
    """Validate ``settings`` against ``fields`` (key -> type); errors name the tier and the key."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        want = fields.get(key)
        if want is None:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"tier {name!r} ({kind}): unknown setting {key!r}; known: {known}")
        try:
            out[key] = coerce(value, want)
        except (TypeError, ValueError) as exc:  # ConfigError from parse_size is a ValueError too
            shown = "<hidden>" if key in secrets else repr(value)
            raise ConfigError(
                f"tier {name!r} ({kind}): setting {key!r} must be {want.__name__}, got {shown}"
            ) from exc
    for key in required:
        if key not in out:
            raise ConfigError(f"tier {name!r} ({kind}): setting {key!r} is required")
    return out


def coerce(value: object, want: type) -> object:
    if want is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise TypeError(value)
    if want is int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise TypeError(value)
        return parse_size(value)
    if want is float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise TypeError(value)
        return float(value)
    if not isinstance(value, str | os.PathLike):
        raise TypeError(value)
    return str(value)
