"""Issue #12: every tier is built one way, from plain values, and the tier list exists once.

``Tier.from_settings(name, settings, context)`` builds every tier (the registry calls it for each
``store_pipeline`` entry, Cache and Posix included); the daemon-wide values a tier needs travel in a
``TierContext``, never as the daemon's config; ``registry.BUILTIN_TIERS`` is the one list the help
text and the start-up check read; a third-party tier written against the old two-argument
``from_settings`` still loads.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Self

import pytest

from ucm_protocol.errors import ConfigError
from ucm_server import config as config_module
from ucm_server.config import FIELDS, ServerConfig, load_config
from ucm_server.store import registry
from ucm_server.store.assembly import assemble
from ucm_server.store.base import Tier, TierContext
from ucm_server.store.cache import CacheTier
from ucm_server.store.ds3fs import DS3FSTier
from ucm_server.store.posix import PosixTier

ROOT = Path(__file__).resolve().parents[1]


def _minimal(name: str, tmp: Path) -> dict[str, object]:
    """The least each built-in tier needs (none of them connects before ``open``)."""
    (tmp / "mnt").mkdir(exist_ok=True)
    return {
        "Cache": {"capacity": "4MiB"},
        "Posix": {"roots": (tmp / "blocks",)},
        "DS3FS": {"mount": str(tmp / "mnt")},
        "Mooncake": {},
        "S3": {"bucket": "b", "endpoint_url": "http://127.0.0.1:1"},
    }[name]


@pytest.mark.parametrize("name", list(registry.BUILTIN_TIERS))
def test_every_builtin_tier_is_built_by_from_settings(tmp_path: Path, name: str) -> None:
    with ThreadPoolExecutor(1) as pool:
        context = TierContext(executor=pool, max_block_bytes=1 << 20)
        tier = registry.build_tier(name, _minimal(name, tmp_path), context)
        assert type(tier) is registry.tier_class(name)
        assert tier.name == name
        if isinstance(tier, PosixTier):  # Posix and DS3FS: headers above the daemon's limit are corrupt
            assert tier.max_block_bytes == 1 << 20
        if type(tier) in (PosixTier, CacheTier):
            assert tier._executor is pool


@pytest.mark.parametrize("name", list(registry.BUILTIN_TIERS))
def test_settings_dataclass_matches_the_constructor(name: str) -> None:
    """A key's default in ``Settings`` is the constructor's: the docs cannot drift from behaviour."""
    cls = registry.tier_class(name)
    assert cls.Settings is not None
    params = inspect.signature(cls.__init__).parameters
    for f in cls.Settings.__dataclass_fields__.values():
        assert f.name in params, f"{name}.Settings.{f.name} is not a constructor parameter"
        default = params[f.name].default
        if default is inspect.Parameter.empty:
            continue
        assert f.default == default, f"{name}.Settings.{f.name}: {f.default!r} != {default!r}"


def test_daemon_config_reaches_cache_and_posix_as_settings(tmp_path: Path) -> None:
    cfg, _ = load_config(
        environ={},
        overrides={
            "data_dir": str(tmp_path),
            "storage_backends": f"{tmp_path}/a:{tmp_path}/b",
            "cache_capacity": "8MiB",
            "cache_page_size": "8KiB",
            "posix_capacity": "1GiB",
            "durable": "false",
            "posix_direct_io": "off",
            "max_block_bytes": "2MiB",
        },
    )
    with ThreadPoolExecutor(1) as pool:
        pipeline = assemble(cfg, pool)
    cache, posix = pipeline.tiers
    assert isinstance(cache, CacheTier) and isinstance(posix, PosixTier)
    assert (cache.arena.capacity, cache.arena.page_size) == (8 << 20, 8 << 10)
    assert posix.roots == [tmp_path / "a", tmp_path / "b"]
    assert (posix.capacity, posix.durable, posix.direct_io) == (1 << 30, False, False)
    assert posix.max_block_bytes == 2 << 20


def test_tier_settings_for_cache_and_posix_are_still_ignored(tmp_path: Path) -> None:
    """As before #12: a ``tier_settings`` entry for Cache or Posix is accepted and has no effect."""
    cfg = ServerConfig(data_dir=tmp_path, tier_settings={"Posix": {"roots": "/elsewhere"}}).validate()
    assert cfg.tier_settings_for("Posix")["roots"] == (tmp_path / "blocks",)


class LegacyTier(PosixTier):
    """A third-party tier written before ``TierContext``: ``from_settings(name, settings)``."""

    @classmethod
    def from_settings(cls, name: str, settings: Mapping[str, object]) -> Self:  # type: ignore[override]
        return cls(name, roots=[Path(str(settings["root"]))])


def test_a_two_argument_from_settings_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._registry, "Legacy", f"{__name__}:LegacyTier")
    with pytest.warns(DeprecationWarning, match="context: TierContext"):
        tier = registry.build_tier("Legacy", {"root": str(tmp_path)}, TierContext(max_block_bytes=12345))
    assert isinstance(tier, LegacyTier)
    assert tier.max_block_bytes == 12345  # what the registry did for every file tier before


class Unbuildable(Tier):
    """A tier with neither ``Settings`` nor its own ``from_settings``."""

    kind = "Unbuildable"


def test_a_tier_without_settings_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._registry, "Unbuildable", f"{__name__}:Unbuildable")
    with pytest.raises(ConfigError, match="cannot be built from configuration"):
        registry.build_tier("Unbuildable", {}, TierContext())


def test_the_tier_list_exists_once() -> None:
    """The help text lists the registry's built-ins in its order; config keeps no copy of them."""
    assert list(registry.BUILTIN_TIERS) == ["Cache", "Posix", "DS3FS", "Mooncake", "S3"]
    assert f"built in: {', '.join(registry.BUILTIN_TIERS)};" in FIELDS["store_pipeline"].metadata["help"]
    assert not hasattr(config_module, "KNOWN_TIERS")
    assert not hasattr(registry, "_BUILTIN")


def test_registry_does_not_import_the_daemon_config() -> None:
    """Building a tier reads plain values: registry.py imports nothing of ucm_server.config, even
    under TYPE_CHECKING, so config.py can import the tier list from it (no loop)."""
    tree = ast.parse((ROOT / "ucm_server/store/registry.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "ucm_server.config" not in imported
    assert not any(m and m.startswith("ucm_server.config") for m in imported)


def test_unknown_tier_is_refused_at_start_naming_store_pipeline(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ucm_server", "--data-dir", str(tmp_path), "--store-pipeline", "Cache|Tape"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "store_pipeline: unknown tier 'Tape'" in proc.stderr
    assert "known: Cache, DS3FS, Mooncake, Posix, S3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ds3fs_built_by_the_daemon_knows_its_block_limit(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    cfg = ServerConfig(
        data_dir=tmp_path,
        store_pipeline="Cache|DS3FS",
        max_block_bytes=1 << 20,
        tier_settings={"DS3FS": {"mount": str(tmp_path / "mnt"), "usrbio": "off"}},
    ).validate()
    with ThreadPoolExecutor(1) as pool:
        ds3fs = assemble(cfg, pool).tiers[1]
    assert isinstance(ds3fs, DS3FSTier) and ds3fs.max_block_bytes == 1 << 20
