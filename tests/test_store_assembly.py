"""One store assembly: every pipeline is built by one function, in the one order of its layers.

The tiers below the top are wrapped encryption first, then the codec, then (with KV events on)
observation, whatever the settings name; the Cache is never wrapped; a tier that once held encoded
blocks keeps a decoding-only codec; and a pipeline, once built, has no way to be rewrapped.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ucm_server.config import load_config
from ucm_server.store.assembly import LAYERS, assemble
from ucm_server.store.base import Tier
from ucm_server.store.cache import CacheTier
from ucm_server.store.compressed import CompressedTier
from ucm_server.store.encrypted import EncryptedTier, TenantKey
from ucm_server.store.observed import ObservedTier
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.posix import PosixTier


class NoKeys:
    """A keyring under which every namespace is stored in clear (the assembly only needs one)."""

    def key_for(self, namespace: bytes) -> TenantKey | None:
        return None


def _config(tmp_path: Path, **overrides: object) -> object:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens: []\n")
    base: dict[str, object] = {"data_dir": str(tmp_path / "data"), "cache_capacity": "8MiB"}
    cfg, _ = load_config(environ={}, overrides={**base, **overrides})
    return cfg


def _chain(tier: Tier) -> list[type]:
    """The tier's layers, outermost first, down to the tier itself."""
    out: list[type] = []
    while True:
        out.append(type(tier))
        inner = getattr(tier, "inner", None)
        if inner is None:
            return out
        tier = inner


def test_layers_wrap_in_the_one_written_order(tmp_path: Path) -> None:
    assert LAYERS == ("encryption", "codec", "observation")
    cfg = _config(
        tmp_path,
        auth_tokens_file=str(tmp_path / "tokens.yaml"),
        encrypt_tiers="Posix",
        codec_tiers="Posix",
        codec_dtype="float16",
        kv_events_endpoint=f"ipc://{tmp_path}/events",
    )
    with ThreadPoolExecutor(1) as pool:
        pipeline = assemble(cfg, pool, NoKeys())  # type: ignore[arg-type]
    cache, posix = pipeline.tiers
    assert isinstance(cache, CacheTier)  # the top tier is never wrapped
    assert _chain(posix) == [ObservedTier, CompressedTier, EncryptedTier, PosixTier]
    assert posix.name == "Posix" and pipeline.tier("Posix") is posix


def test_without_settings_the_tiers_are_bare(tmp_path: Path) -> None:
    with ThreadPoolExecutor(1) as pool:
        pipeline = assemble(_config(tmp_path), pool)  # type: ignore[arg-type]
    assert [_chain(t) for t in pipeline.tiers] == [[CacheTier], [PosixTier]]
    for name in ("wrap", "make_watchable"):  # a built pipeline is not rewrapped
        assert not hasattr(Pipeline, name)


def test_a_tier_that_held_encoded_blocks_keeps_decoding(tmp_path: Path) -> None:
    with ThreadPoolExecutor(1) as pool:
        on = assemble(_config(tmp_path, codec_tiers="Posix", codec_dtype="float16"), pool)  # type: ignore[arg-type]
        off = assemble(_config(tmp_path), pool)  # type: ignore[arg-type]
    encoding, decoding = on.tiers[1], off.tiers[1]
    assert isinstance(encoding, CompressedTier) and isinstance(decoding, CompressedTier)
    assert (encoding.dtype, decoding.dtype) == ("float16", None)  # the second one only decodes
    assert _chain(decoding) == [CompressedTier, PosixTier]
    assert (tmp_path / "data" / "codec_tiers.json").exists()
