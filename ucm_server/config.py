"""The daemon's configuration checked: every rule between settings, and the values that follow from them.

:class:`ServerConfig` is :class:`~ucm_server.server_settings.ServerSettings` (every setting, its type,
default and help) with :meth:`ServerConfig.validate`, which stops start-up with a :class:`ConfigError`
naming the key at the first bad value or combination, and the derived views the daemon reads (the tier
list, the Posix roots, each tier's settings). :mod:`ucm_server.config_sources` loads one from
defaults < YAML < ``UCM_*`` env < flags.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

from ucm_protocol.errors import ConfigError
from ucm_server.server_settings import ServerSettings
from ucm_server.store.admission import policy_class
from ucm_server.store.codec import CODECS
from ucm_server.store.codec import DTYPES as CODEC_DTYPES
from ucm_server.store.registry import known_tiers
from ucm_server.tracing import check_settings as check_tracing

__all__ = ["LOG_LEVELS", "ServerConfig"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True, slots=True)
class ServerConfig(ServerSettings):
    """Every setting of ``ucm-server`` (see each field's help), checked by :meth:`validate`."""

    # -- derived ----------------------------------------------------------------------------------------
    @property
    def tiers(self) -> list[str]:
        return [t.strip() for t in self.store_pipeline.split("|")]

    @property
    def kv_events_topic_name(self) -> str:
        """The topic of KV event batches: ``kv_events_topic``, else ``kv@<node>@ucm`` (llm-d's form)."""
        return self.kv_events_topic or f"kv@{self.kv_events_node or socket.gethostname()}@ucm"

    @property
    def posix_roots(self) -> list[Path]:
        if not self.storage_backends:
            return [self.data_dir / "blocks"]
        return [Path(p) for p in self.storage_backends.split(":") if p]

    @property
    def tcp_anonymous(self) -> bool:
        """A TCP listener that checks no credentials: no tokens and no client certificates (which
        need TLS); its peers are anonymous and never admins (see ``allow_anonymous_tcp``)."""
        return bool(self.listen) and not self.auth_tokens_file and not (self.tls_client_ca and self.tls_cert)

    @property
    def compressed_tiers(self) -> list[str]:
        return [t.strip() for t in self.codec_tiers.split("|") if t.strip()]

    @property
    def encrypted_tiers(self) -> list[str]:
        return [t.strip() for t in self.encrypt_tiers.split("|") if t.strip()]

    def tier_settings_for(self, name: str) -> dict[str, object]:
        """The settings the tier ``name`` of the pipeline is built from: the flat ``cache_*`` and
        ``posix_*`` keys for Cache and Posix (their ``tier_settings`` entries are ignored, as they
        always were), the ``tier_settings`` entry for every other tier."""
        if name == "Cache":
            return {
                "capacity": self.cache_capacity,
                "page_size": self.cache_page_size,
                "prefault": self.cache_prefault,
                "eviction": self.cache_eviction,
            }
        if name == "Posix":
            return {
                "roots": tuple(self.posix_roots),
                "capacity": self.posix_capacity,
                "durable": self.durable,
                "direct_io": self.posix_direct_io,
                "index_wait_s": self.posix_index_wait_s,
                "snapshot_interval_s": self.posix_snapshot_interval_s,
                "pack_max_block_bytes": self.posix_pack_max_block_bytes,
            }
        return dict(self.tier_settings.get(name, {}))

    def validate(self) -> ServerConfig:
        tiers = self.tiers
        known = known_tiers()
        for t in tiers:
            if t not in known and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", t):
                raise ConfigError(
                    f"store_pipeline: unknown tier {t!r} in {self.store_pipeline!r}; "
                    f"known: {', '.join(known)}"
                )
        if len(set(tiers)) != len(tiers):
            raise ConfigError(f"store_pipeline: a tier appears twice in {self.store_pipeline!r}")
        if "Cache" in tiers and tiers[0] != "Cache":
            raise ConfigError(f"store_pipeline: Cache must be the first tier, got {self.store_pipeline!r}")
        if self.cache_page_size < 4096 or self.cache_page_size & (self.cache_page_size - 1):
            raise ConfigError(f"cache_page_size: must be a power of two >= 4096, got {self.cache_page_size}")
        for name in self.encrypted_tiers:
            if name not in tiers or name == tiers[0]:
                raise ConfigError(
                    f"encrypt_tiers: {name!r} is not a tier below the first of {self.store_pipeline!r}"
                )
        for name in self.compressed_tiers:
            if name not in tiers or name == tiers[0]:
                raise ConfigError(
                    f"codec_tiers: {name!r} is not a tier below the first of {self.store_pipeline!r}"
                )
        if self.codec not in CODECS:
            raise ConfigError(f"codec: unknown codec {self.codec!r}; known: {', '.join(CODECS)}")
        if self.codec_dtype not in CODEC_DTYPES:
            raise ConfigError(
                f"codec_dtype: {self.codec_dtype!r} is not an element type the codec takes; "
                f"known: {', '.join(CODEC_DTYPES)}"
            )
        if self.encrypted_tiers and not self.auth_tokens_file:
            raise ConfigError("encrypt_tiers: keys are per tenant: set auth_tokens_file, with key_file")
        if "Cache" in tiers and self.cache_capacity < self.cache_page_size:
            raise ConfigError(f"cache_capacity: {self.cache_capacity} is smaller than one page")
        for name in (
            "io_threads",
            "writeback_batch_blocks",
            "max_batch_blocks",
            "max_block_bytes",
            "max_segments_per_block",
            "max_segments_per_request",
            "staging_bytes",
            "reply_bytes",
            "max_sessions",
            "max_sessions_per_peer",
            "max_tasks_per_session",
            "max_session_regions",
            "max_session_region_bytes",
            "max_pending_handovers",
            "max_retention_rules",
            "dataplane_ring_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if not 0 <= self.pin_reserve < 1:
            raise ConfigError(f"pin_reserve: expected a share in [0, 1), got {self.pin_reserve}")
        if not 0 <= self.pin_share <= 1:
            raise ConfigError(f"pin_share: expected a share in [0, 1], got {self.pin_share}")
        for name in ("admission_daemon", "admission_local", "admission_shared"):
            policy_class(getattr(self, name), name)  # a clear error naming the setting and the choices
        if not self.admission_window_s > 0 or self.admission_window_keys <= 0:
            raise ConfigError(
                f"admission_window_s / admission_window_keys: must be positive, got "
                f"{self.admission_window_s} / {self.admission_window_keys}"
            )
        if not 0 <= self.io_background_hold_s <= 1:
            raise ConfigError(
                f"io_background_hold_s: expected seconds in [0, 1], got {self.io_background_hold_s}"
            )
        if not 0 <= self.writeback_wait_s <= 60:
            raise ConfigError(f"writeback_wait_s: expected seconds in [0, 60], got {self.writeback_wait_s}")
        if self.writeback_max_bytes < 0:
            raise ConfigError(f"writeback_max_bytes: must be 0 or more, got {self.writeback_max_bytes}")
        if not 0 <= self.posix_pack_max_block_bytes <= 8 << 20:
            raise ConfigError(
                f"posix_pack_max_block_bytes: must be 0 (off) to 8 MiB, got {self.posix_pack_max_block_bytes}"
            )
        if not self.posix_snapshot_interval_s >= 0:
            raise ConfigError(
                "posix_snapshot_interval_s: must be 0 (off) or more seconds, "
                f"got {self.posix_snapshot_interval_s}"
            )
        if not self.shared_lookup_ttl_s >= 0:
            raise ConfigError(f"shared_lookup_ttl_s: must be 0 or more, got {self.shared_lookup_ttl_s}")
        for name in ("task_retention_s", "heartbeat_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"log_level: {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.listen:
            _check_host_port("listen", self.listen)
            if not self.insecure and not (self.tls_cert and self.tls_key):
                raise ConfigError(
                    "listen: a TCP listener needs tls_cert and tls_key, or insecure: true to run without TLS"
                )
            if self.tcp_anonymous and not self.allow_anonymous_tcp:
                raise ConfigError(
                    f"listen: the TCP listener {self.listen} would let any peer that reaches it in "
                    "without credentials: set auth_tokens_file (tokens) or tls_client_ca (client "
                    "certificates, with tls_cert), or allow_anonymous_tcp: true to accept anonymous "
                    "peers (never admins)"
                )
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca: client certificates need TLS: set tls_cert and tls_key too")
        if self.metrics_address not in ("", "off"):
            _check_host_port("metrics_address", self.metrics_address)
        for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, key)
            if value and value != "local" and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(
                    f"{key}: {value!r} is not a ZeroMQ address (local, tcp://, ipc:// or inproc://)"
                )
        if self.kv_events_heartbeat_s < 0:
            raise ConfigError(
                f"kv_events_heartbeat_s: must be 0 (off) or more, got {self.kv_events_heartbeat_s}"
            )
        if self.kv_events_subscribers_file and not self.kv_events_curve_secret_key_file:
            raise ConfigError(
                "kv_events_subscribers_file: subscribers are told apart by their CURVE keys: set "
                "kv_events_curve_secret_key_file too"
            )
        if self.kv_events_curve_secret_key_file and not self.kv_events_subscribers_file:
            raise ConfigError(
                "kv_events_curve_secret_key_file: set kv_events_subscribers_file too (whose keys may "
                "subscribe, and to which tenant's events)"
            )
        for key in ("kv_events_persistent_medium", "kv_events_shared_medium"):
            if not getattr(self, key):
                raise ConfigError(f"{key}: must not be empty")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("kv_events_replay_endpoint: set kv_events_endpoint too (replay of what?)")
        if self.kv_events_buffer_batches < 1:
            raise ConfigError(
                f"kv_events_buffer_batches: must be 1 or more, got {self.kv_events_buffer_batches}"
            )
        check_tracing(self)
        unknown = set(self.tier_settings) - set(tiers)
        if unknown:
            raise ConfigError(
                f"tier_settings: {sorted(unknown)} not in store_pipeline {self.store_pipeline!r}"
            )
        return self


def _check_host_port(key: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{key}: expected host:port, got {value!r}")
