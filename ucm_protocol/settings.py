"""Settings values both sides parse the same way (sizes like ``"4GiB"``), raising one ``ConfigError``."""

from __future__ import annotations

import re

from ucm_protocol.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(value: object, key: str = "size") -> int:
    """Bytes from an int or a string like ``"512MiB"``, ``"4G"``, ``"1.5 GB"`` (1024-based either way)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like '4GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: size must not be negative, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"{key}: expected a size like '4GiB' or a number of bytes, got {value!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    return int(number * 1024 ** " kmgtp".index(unit or " "))
