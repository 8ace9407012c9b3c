"""``ucm_sparse_config``: typed, validated, immutable.

The seed format is kept::

    ucm_sparse_config:
      enabled: true
      min_seq_len: 256
      ESA: {sparse_ratio: 0.3, local_window_sz: 2, init_window_sz: 1, retrieval_stride: 5, min_blocks: 4}

Exactly one method section is expected unless ``algorithm`` names the one to use. Third-party methods
add ``module_path`` / ``class_name``. Unknown keys are errors that name the key, never ignored: a typo
in ``sparse_ratio`` must not silently run dense attention. The config reaches the worker through the
connector's ``kv_connector_extra_config["ucm_sparse_config"]``; the environment variable
``UCM_SPARSE_CONFIG`` (JSON) overrides it, following the project's priority order.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from ucm_client.sparse.errors import SparseConfigError
from ucm_protocol.errors import ConfigError
from ucm_protocol.settings import load_fields, parse_bool

__all__ = [
    "ENV_VAR",
    "BlockBudget",
    "UcmSparseConfig",
    "load_sparse_config",
    "parse_fields",
]

ENV_VAR = "UCM_SPARSE_CONFIG"
_TOP_LEVEL = frozenset({"enabled", "min_seq_len", "algorithm", "module_path", "class_name"})

T = TypeVar("T")


def parse_fields(cls: type[T], raw: Mapping[str, Any], where: str) -> T:
    """Build the frozen dataclass ``cls`` from ``raw``, rejecting unknown keys and wrong types.

    The one settings loader in strict mode: values must already have their type (this is structured
    data, not text). Ints are accepted where floats are expected (``sparse_ratio: 1``); bools are
    never accepted as numbers, because ``True`` for a window size is always a mistake.
    """
    try:
        kwargs = load_fields(cls, raw, where, at=lambda key: f"{where}.{key}", source="strict")
    except ConfigError as exc:
        raise SparseConfigError(str(exc)) from None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise SparseConfigError(f"{where}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class BlockBudget:
    """How many KV blocks a block-sparse method keeps for one decode query.

    Shared by ESA, GSA and KVStarMultiStep so that "20% budget" means the same thing for all three.
    """

    sparse_ratio: float = 0.3
    """Fraction of the sequence's blocks attended to; 1.0 means dense."""
    init_window_sz: int = 1
    """Leading blocks always kept (attention sinks)."""
    local_window_sz: int = 2
    """Trailing blocks always kept, the partial last block included; at least 1."""
    min_blocks: int = 4
    """Never keep fewer blocks than this (short sequences stay nearly dense)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.sparse_ratio <= 1.0:
            raise ValueError(f"sparse_ratio must be in (0, 1], got {self.sparse_ratio}")
        if self.init_window_sz < 0:
            raise ValueError(f"init_window_sz must be >= 0, got {self.init_window_sz}")
        if self.local_window_sz < 1:
            raise ValueError(
                f"local_window_sz must be >= 1 (the block being written), got {self.local_window_sz}"
            )
        if self.min_blocks < 1:
            raise ValueError(f"min_blocks must be >= 1, got {self.min_blocks}")

    def num_kept(self, num_blocks: int) -> int:
        """Blocks kept out of ``num_blocks``: ratio-based, at least ``min_blocks`` and the windows."""
        if self.sparse_ratio >= 1.0:
            return num_blocks
        want = max(
            math.ceil(self.sparse_ratio * num_blocks),
            self.min_blocks,
            self.init_window_sz + self.local_window_sz,
        )
        return min(num_blocks, want)


@dataclass(frozen=True, slots=True)
class UcmSparseConfig:
    """The parsed ``ucm_sparse_config``; ``method_config`` is the chosen method's own section."""

    algorithm: str
    method_config: Mapping[str, Any]
    enabled: bool = True
    min_seq_len: int = 0
    module_path: str | None = None
    class_name: str | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> UcmSparseConfig:
        """Parse upstream UCM's format; the method section itself is validated by the method's spec."""
        if not isinstance(raw, Mapping):
            raise SparseConfigError(f"ucm_sparse_config: expected a mapping, got {type(raw).__name__}")
        sections = {k: v for k, v in raw.items() if k not in _TOP_LEVEL}
        algorithm = raw.get("algorithm")
        if algorithm is None:
            if len(sections) != 1:
                raise SparseConfigError(
                    "ucm_sparse_config: expected exactly one method section (or 'algorithm'), "
                    f"got {sorted(sections)}"
                )
            algorithm = next(iter(sections))
        if not isinstance(algorithm, str):
            raise SparseConfigError(f"ucm_sparse_config.algorithm: expected str, got {algorithm!r}")
        extra = sorted(set(sections) - {algorithm})
        if extra:
            raise SparseConfigError(
                f"ucm_sparse_config: section(s) {extra} do not match algorithm {algorithm!r}"
            )
        section = sections.get(algorithm) or {}  # upstream UCM's `MySparse:` with an empty body is None
        if not isinstance(section, Mapping):
            raise SparseConfigError(f"ucm_sparse_config.{algorithm}: expected a mapping")
        min_seq_len = raw.get("min_seq_len", 0)
        try:
            enabled = parse_bool(raw.get("enabled", True), "ucm_sparse_config.enabled", source="strict")
        except ConfigError as exc:
            raise SparseConfigError(str(exc)) from None
        if not isinstance(min_seq_len, int) or isinstance(min_seq_len, bool) or min_seq_len < 0:
            raise SparseConfigError(f"ucm_sparse_config.min_seq_len: expected int >= 0, got {min_seq_len!r}")
        module_path, class_name = raw.get("module_path"), raw.get("class_name")
        if (module_path is None) != (class_name is None):
            raise SparseConfigError("ucm_sparse_config: module_path and class_name go together")
        return cls(
            algorithm=algorithm,
            method_config=MappingProxyType(dict(section)),
            enabled=enabled,
            min_seq_len=min_seq_len,
            module_path=module_path,
            class_name=class_name,
        )


def load_sparse_config(extra_config: Mapping[str, Any] | None) -> UcmSparseConfig | None:
    """The effective config: ``$UCM_SPARSE_CONFIG`` (JSON) over ``extra_config["ucm_sparse_config"]``.

    Returns ``None`` when neither is set, meaning "sparse attention off".
    """
    env = os.environ.get(ENV_VAR)
    if env:
        try:
            raw = json.loads(env)
        except json.JSONDecodeError as exc:
            raise SparseConfigError(f"{ENV_VAR}: not valid JSON ({exc})") from exc
        return UcmSparseConfig.from_dict(raw)
    if extra_config and "ucm_sparse_config" in extra_config:
        return UcmSparseConfig.from_dict(extra_config["ucm_sparse_config"])
    return None
