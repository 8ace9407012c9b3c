"""Validation of a tier's ``tier_settings`` entry from a ``{key: type}`` mapping (kept for tiers
written before :attr:`Tier.Settings <ucm_server.store.base.Tier.Settings>`; until 0.2).

New tiers declare a ``Settings`` dataclass and let :meth:`Tier.from_settings
<ucm_server.store.base.Tier.from_settings>` check it. Both go through the one settings loader, so the
rules and messages are the same: strings parsed (``"256MiB"`` for ints, ``"true"``/``"off"`` for
bools), unknown keys and bad values named with the tier and the key, a secret's value never shown.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ucm_protocol.errors import ConfigError
from ucm_protocol.settings import coerce as _coerce

__all__ = ["check_settings", "coerce"]


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
    where = f"tier {name!r} ({kind})"
    out: dict[str, Any] = {}
    for key, value in settings.items():
        want = fields.get(key)
        if want is None:
            raise ConfigError(f"{where}: unknown key {key!r}; known: {', '.join(sorted(fields))}")
        out[key] = coerce(value, want, f"{where}: setting {key!r}", secret=key in secrets)
    for key in required:
        if key not in out:
            raise ConfigError(f"{where}: setting {key!r} is required")
    return out


def coerce(value: object, want: type, where: str = "setting", *, secret: bool = False) -> object:
    """``value`` as ``want`` by the tier rules (every int is a size); a bad value is a ConfigError."""
    return _coerce(want, value, where, size=want is int, source="structured", secret=secret)
