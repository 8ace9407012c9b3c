"""One store assembly: the pipeline built from the settings, once, in one written order.

``store_pipeline`` names the tiers, fastest first. :func:`assemble` builds each one (by the
registry's :func:`~ucm_server.store.registry.build_tier`), wraps the tiers below the top in the
layers of :data:`LAYERS`, always in this order, and hands the result to a
:class:`~ucm_server.store.pipeline.Pipeline`, which nothing changes afterwards:

===============  ==================================================================================
layer            what it does (inner first)
===============  ==================================================================================
``encryption``   ``encrypt_tiers``: each tenant's blocks sealed with its key (the tenants' keyring)
``codec``        ``codec_tiers``: blocks compressed at rest; outside the encryption, as ciphertext does
                 not compress. A tier that ever held encoded blocks keeps a decoding-only codec
                 (``<data_dir>/codec_tiers.json`` remembers which), so turning the codec off never
                 turns its blocks into garbage
``observation``  with KV events on (``kv_events_endpoint``), a tier without a watchable index is
                 watched through its calls (:class:`~ucm_server.store.observed.ObservedTier`)
===============  ==================================================================================

A write passes the layers outermost first (observation, codec, encryption, then the tier), a read
comes back the other way. The top tier (the Cache) gets none of these layers: it is memory, and the
pipeline leases its pages. One wrapper may go around every tier, the top one included, outside all
layers: tracing's (``outermost``), which leases through to the Cache unchanged. Last, the admission
policies (``admission_*``) take their places at the boundaries below the Cache
(:func:`~ucm_server.store.admitting.install_admission`), before anything opens the pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Literal, Protocol

from ucm_server.journal import remember_names
from ucm_server.store.admitting import AdmissionConfig, install_admission
from ucm_server.store.base import EvictionRules, Tier, TierContext
from ucm_server.store.compressed import CompressedTier
from ucm_server.store.encrypted import EncryptedTier, Keyring
from ucm_server.store.observed import ObservedTier
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.registry import build_tier
from ucm_server.store.staging import StagingPool
from ucm_server.store.watch import Watchable

log = logging.getLogger(__name__)

LAYERS = ("encryption", "codec", "observation")
"""The wrappers of a tier below the top, inner first: the one order every pipeline is built in."""
CODEC_FILE = "codec_tiers.json"
_CODEC_FIX = (
    "fix the file (a JSON list of the tiers that hold blocks compressed at rest); remove a tier only "
    "once it holds no encoded block"
)


class AssemblyConfig(AdmissionConfig, Protocol):
    """What :func:`assemble` reads of the daemon's config (``ServerConfig`` has all of it)."""

    @property
    def tiers(self) -> Sequence[str]: ...
    @property
    def write_mode(self) -> str: ...
    @property
    def io_threads(self) -> int: ...
    @property
    def shared_lookup_ttl_s(self) -> float: ...
    @property
    def staging_bytes(self) -> int: ...
    @property
    def max_block_bytes(self) -> int: ...
    @property
    def writeback_max_bytes(self) -> int: ...
    @property
    def writeback_wait_s(self) -> float: ...
    @property
    def writeback_batch_blocks(self) -> int: ...
    @property
    def writeback_overflow(self) -> Literal["cache-only", "write-through"]: ...
    def tier_settings_for(self, name: str) -> Mapping[str, object]: ...

    @property
    def data_dir(self) -> Path: ...
    @property
    def codec(self) -> str: ...
    @property
    def codec_dtype(self) -> str: ...
    @property
    def compressed_tiers(self) -> list[str]: ...
    @property
    def encrypted_tiers(self) -> list[str]: ...
    @property
    def kv_events_endpoint(self) -> str: ...


def assemble(
    config: AssemblyConfig,
    executor: Executor,
    keyring: Keyring | None = None,
    rules: EvictionRules | None = None,
    outermost: Callable[[Tier], Tier] | None = None,
) -> Pipeline:
    """The daemon's pipeline: its tiers, each in its layers, under the pipeline's settings.
    ``keyring``: the tenants' keys, needed when ``encrypt_tiers`` names a tier; ``rules``: the
    retention rules the tiers evict under; ``outermost``: a wrapper around every tier, the top one
    included, outside every layer (tracing: its span then times the whole call)."""
    context = TierContext(executor=executor, max_block_bytes=config.max_block_bytes)
    tiers = [build_tier(name, config.tier_settings_for(name), context) for name in config.tiers]
    tiers = tiers[:1] + layered(tiers[1:], config, executor, keyring)
    if outermost is not None:
        tiers = [outermost(tier) for tier in tiers]
    pipeline = Pipeline(
        tiers,
        write_back=config.write_mode == "write-back",
        flushers=max(2, config.io_threads // 2),
        shared_lookup_ttl_s=config.shared_lookup_ttl_s,
        staging=StagingPool(config.staging_bytes),
        executor=executor,
        writeback_max_bytes=config.writeback_max_bytes,
        writeback_wait_s=config.writeback_wait_s,
        writeback_overflow=config.writeback_overflow,
        flush_batch=config.writeback_batch_blocks,
        rules=rules,
    )
    pipeline.admission = install_admission(pipeline, config)  # the boundaries' policies, last
    return pipeline


def layered(
    tiers: Sequence[Tier], config: AssemblyConfig, executor: Executor | None, keyring: Keyring | None
) -> list[Tier]:
    """``tiers`` (the ones below the top) each wrapped in :data:`LAYERS`, inner first."""
    names = [t.name for t in tiers]
    wrappers: dict[str, dict[str, Callable[[Tier], Tier]]] = {
        "encryption": _encryption(config, executor, keyring),
        "codec": _codecs(config, names, executor),
        "observation": dict.fromkeys(names, observation) if config.kv_events_endpoint else {},
    }
    out: list[Tier] = []
    for name, tier in zip(names, tiers, strict=True):
        wrapped = tier
        for layer in LAYERS:
            wrap = wrappers[layer].get(name)
            if wrap is not None:
                wrapped = wrap(wrapped)
        out.append(wrapped)
    return out


def observation(tier: Tier) -> Tier:
    """KV events: a tier without a watchable index, watched through what its calls return."""
    return tier if isinstance(tier, Watchable) else ObservedTier(tier)


def _encryption(
    config: AssemblyConfig, executor: Executor | None, keyring: Keyring | None
) -> dict[str, Callable[[Tier], Tier]]:
    """``encrypt_tiers`` sealed with the tenants' keys."""
    names = config.encrypted_tiers
    if not names:
        return {}
    if keyring is None:
        raise ValueError("encrypt_tiers names tiers, but no keyring was given")
    log.info("encryption at rest: %s", ", ".join(names))
    return dict.fromkeys(names, lambda tier: EncryptedTier(tier, keyring, executor))


def _codecs(
    config: AssemblyConfig, known: list[str], executor: Executor | None
) -> dict[str, Callable[[Tier], Tier]]:
    """The codec of each tier: ``codec_tiers`` encode and decode; a tier that ever held encoded
    blocks (the file remembers) only decodes."""
    names = config.compressed_tiers
    path = config.data_dir / CODEC_FILE
    ever = remember_names(path, names, "compressed tiers", _CODEC_FIX)
    for name in sorted(ever - set(names) - set(known)):
        log.warning("%s lists tier %r, which is not in store_pipeline now", path, name)
    dtype = config.codec_dtype
    decoding = sorted((ever - set(names)) & set(known))
    if names or decoding:
        log.info(
            "compression at rest: %s (%s, %s); decoding only: %s",
            ", ".join(names) or "none",
            config.codec,
            dtype,
            ", ".join(decoding) or "none",
        )
    out: dict[str, Callable[[Tier], Tier]] = {}
    for name in names:
        out[name] = lambda tier: CompressedTier(tier, dtype, executor)
    for name in decoding:
        out[name] = lambda tier: CompressedTier(tier, None, executor)
    return out
