"""The one settings loader: typed dataclass fields from YAML, environment, flags or plain mappings.

It lives in ``ucm_protocol`` because both sides use it: the daemon (its config, tier settings, the
fault wrappers) and the client (the vLLM connector's config, the sparse config).

Every part of UCM that reads settings (the daemon's config, a tier's ``tier_settings`` entry, the
fault wrappers, the vLLM connector's config, the sparse config) declares them as a dataclass and
loads them here, so the rules are the same everywhere:

- the type comes from the field's annotation: ``bool``, ``int``, ``float``, ``str``, ``Path``,
  ``Literal[...]`` choices, ``X | None``, ``tuple[X, ...]``, mappings; a field with
  ``metadata={"size": True}`` takes a size like ``"4GiB"`` (:func:`parse_size`);
- one bool vocabulary (:data:`TRUE` / :data:`FALSE`, case and surrounding space ignored);
- an unknown key is an error naming it and the known ones; a bad value names the key and where it
  came from, and never shows the value of a secret;
- every error is a :class:`ConfigError`.

How much text is parsed depends on where the values come from (:data:`Source`): ``"text"`` for the
daemon's YAML/environment/flags (every scalar may arrive as a string), ``"structured"`` for mappings
whose strings are parsed into bools and numbers but whose strings must be strings, and ``"strict"``
for sources where a value must already have its type (the sparse config: ``"yes"`` for a bool there
is a mistake, not a spelling).
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from ucm_protocol.errors import ConfigError

__all__ = [
    "FALSE",
    "TRUE",
    "ConfigError",
    "Source",
    "coerce",
    "load_fields",
    "parse_bool",
    "parse_size",
    "read_yaml_mapping",
]

TRUE = frozenset({"1", "true", "yes", "on"})
"""Spellings of true (compared lower-cased, without surrounding space)."""
FALSE = frozenset({"0", "false", "no", "off"})
"""Spellings of false."""

Source = Literal["text", "structured", "strict"]
"""How a value may be spelled: ``text`` (YAML, environment, flags: strings for anything, numbers
read as strings where a string is wanted), ``structured`` (strings parsed into bools and numbers; a
string field needs a string), ``strict`` (the value already has the field's type)."""

HIDDEN = "<hidden>"

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
    scale = int(1024 ** " kmgtp".index(m.group(2).lower() or " "))
    if m.group(1).isdigit():  # exact: a float loses bytes past 2**53 ("18446744073709551615" -> 2**64)
        return int(m.group(1)) * scale
    return int(float(m.group(1)) * scale)


def parse_bool(value: object, where: str, *, source: Source = "text", shown: str | None = None) -> bool:
    """A bool, or (unless ``strict``) one of the :data:`TRUE` / :data:`FALSE` spellings."""
    if isinstance(value, bool):
        return value
    if source != "strict" and isinstance(value, str | int):
        text = str(value).strip().lower()
        if text in TRUE:
            return True
        if text in FALSE:
            return False
    raise ConfigError(f"{where}: expected bool, got {shown or repr(value)}")


def coerce(
    hint: Any, value: object, where: str, *, size: bool = False, source: Source = "text", secret: bool = False
) -> Any:
    """``value`` as the type ``hint`` says; errors read ``"{where}: expected <what>, got <value>"``."""
    shown = HIDDEN if secret else repr(value)

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{where}: expected {what}, got {shown}")

    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):  # X | None
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return coerce(inner, value, where, size=size, source=source, secret=secret)
    if size:
        if source == "strict" and (isinstance(value, bool) or not isinstance(value, int)):
            raise bad("a number of bytes")
        try:
            return parse_size(value, where)
        except ConfigError:
            if secret:
                raise bad("a size like '4GiB'") from None
            raise
    if hint is bool:
        return parse_bool(value, where, source=source, shown=shown)
    if hint in (int, float):
        return _number(hint, value, source, bad)
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike) and source != "strict":
            return os.fspath(value)
        if source == "text" and isinstance(value, int | float):
            return str(value)
        raise bad("a string")
    if hint is Path:
        if source == "strict" and not isinstance(value, str | os.PathLike):
            raise bad("a path")
        return Path(os.path.expanduser(str(value)))
    if origin is Literal:
        if value not in args:
            raise bad(f"one of {', '.join(map(str, args))}")
        return value
    if origin is tuple:
        item = args[0] if args else Any
        what = f"a list of {_plural(item)}"
        if isinstance(value, Mapping) and source != "strict":
            value = [value]  # one entry where a list of mappings is wanted
        if not isinstance(value, list | tuple):
            raise bad(what)
        try:
            return tuple(coerce(item, v, where, source=source, secret=secret) for v in value)
        except ConfigError:
            raise bad(what) from None
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        if isinstance(value, str) and source == "text":
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as exc:
                raise ConfigError(f"{where}: not valid YAML ({exc})") from None
        if not isinstance(value, Mapping):
            raise bad("a mapping")
        return dict(value)
    if hint is Any:
        return value
    raise TypeError(f"{where}: no rule for settings of type {hint!r}")  # a programming error


def _plural(hint: Any) -> str:
    """What a list of ``hint`` holds, for messages."""
    if hint is Mapping or get_origin(hint) in (dict, Mapping):
        return "mappings"
    return {str: "strings", Path: "paths", int: "ints", float: "floats", bool: "bools"}.get(hint, "values")


def _number(hint: type, value: object, source: Source, bad: Callable[[str], ConfigError]) -> Any:
    """int/float. ``text`` and ``structured`` take whatever ``int()``/``float()`` takes (as every
    loader did), except that only ``text`` takes a bool; ``strict`` takes the type itself (an int for
    a float too), never a bool."""
    what = "int" if hint is int else "float"
    if isinstance(value, bool) and source != "text":
        raise bad(what)
    if source == "strict":
        if not isinstance(value, int if hint is int else int | float):
            raise bad(what)
        return hint(value)
    try:
        return hint(value)
    except (TypeError, ValueError, OverflowError):
        raise bad(what) from None


def load_fields(
    cls: type[Any],
    raw: Mapping[str, object],
    where: str,
    *,
    at: Callable[[str], str] | None = None,
    source: Source = "text",
    secrets: Collection[str] = (),
    skip: Collection[str] = (),
    sizes: bool = False,
    required: bool = True,
) -> dict[str, Any]:
    """The keys of ``raw`` checked against dataclass ``cls`` and converted to its field types.

    Returns only the keys present (the caller's defaults apply to the rest). ``at(key)`` says where a
    key sits, for messages (default ``"{where}: {key}"``); ``skip`` lists keys to pass over;
    ``sizes`` treats every int field as a size; ``required`` makes fields without a default required.
    Field metadata: ``{"size": True}`` (a size), ``{"secret": True}`` (never shown, like ``secrets``).
    """
    locate = at or (lambda key: f"{where}: {key}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = get_type_hints(cls)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in skip:
            continue
        f = fields.get(key)
        if f is None:
            raise ConfigError(f"{where}: unknown key {key!r}; known: {', '.join(fields)}")
        hint = hints[key]
        size = bool(f.metadata.get("size")) or (sizes and hint is int)
        secret = key in secrets or bool(f.metadata.get("secret"))
        out[key] = coerce(hint, value, locate(key), size=size, source=source, secret=secret)
    if required:
        for name, f in fields.items():
            missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if missing and name not in out:
                raise ConfigError(f"{locate(name)} is required")
    return out


MAX_CONFIG_BYTES = 16 << 20
"""The largest YAML file read as configuration. ``--config /dev/zero`` (or a log named by mistake) was
read whole: a MemoryError traceback, or the host's memory, before any message."""


def read_config_text(path: Path, source: str) -> str:
    """The text of a configuration file, at most :data:`MAX_CONFIG_BYTES`; failures are ConfigErrors.

    Read in one bounded call rather than checked by size first, so pipes (``--config <(...)``) and
    devices work, and a file that is endless or huge is refused after the cap."""
    try:
        with Path(path).open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read ({exc.strerror or exc})") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: more than {MAX_CONFIG_BYTES >> 20} MiB; is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def read_yaml_mapping(path: Path, what: str = "config file") -> dict[str, Any]:
    """The top-level mapping of a YAML file (empty file: ``{}``); any failure is a ConfigError."""
    source = f"{what} {path}"
    text = read_config_text(path, source)
    try:
        doc = yaml.safe_load(text)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read ({exc.strerror or exc})") from exc
    except (yaml.YAMLError, ValueError) as exc:  # PyYAML raises ValueError for impossible dates
        raise ConfigError(f"{source}: not valid YAML ({exc})") from exc
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(doc).__name__}")
    return doc
