"""A tokens file for ``ucm-server --auth-tokens-file``, as tests need one: tokens in, digests out."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml


def tokens_file(path: Path, entries: Iterable[tuple[str, str, Mapping[str, object]]]) -> Path:
    """Write ``(token, tenant, extra)`` entries (extra: ``quota``, ``admin``) with each token stored
    as the SHA-256 digest the daemon compares against; returns ``path``."""
    tokens = [
        {"token_sha256": hashlib.sha256(token.encode()).hexdigest(), "tenant": tenant, **extra}
        for token, tenant, extra in entries
    ]
    path.write_text(yaml.safe_dump({"tokens": tokens}, sort_keys=False))
    return path
