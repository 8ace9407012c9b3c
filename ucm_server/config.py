"""The daemon's configuration: one typed dataclass, loaded from defaults < YAML < ``UCM_*`` env < flags.

Every field documents itself (``help`` metadata), which is what ``ucm-server --help``, ``--print-config``
and docs/configuration.md are generated from. Unknown keys and bad values stop
start-up with a :class:`ConfigError` that names the key and where it came from; nothing is silently
ignored.

YAML may use the flat form (``store_pipeline: "Cache|Posix"``) or the seed ``001`` form
(``ucm_connectors: [{ucm_connector_name: ..., ucm_connector_config: {...}}]``), whose first connector
config is read.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_type_hints

from ucm_protocol.errors import ConfigError
from ucm_protocol.settings import coerce, parse_size, read_yaml_mapping
from ucm_server.api.paths import default_data_dir, default_socket_path
from ucm_server.store.admission import policy_class
from ucm_server.store.codec import CODECS
from ucm_server.store.codec import DTYPES as CODEC_DTYPES
from ucm_server.store.registry import BUILTIN_TIERS, known_tiers
from ucm_server.tracing import check_settings as check_tracing

__all__ = ["FIELDS", "ServerConfig", "describe", "load_config", "parse_size", "read_env", "read_yaml"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# UCM_* variables read by clients or by other parts of the product, not by the daemon's config.
_CLIENT_ENV = {
    "UCM_CONFIG_FILE",
    "UCM_SERVER_CONFIG",  # which file --config defaults to (ucm_protocol.paths.SERVER_CONFIG_ENV)
    "UCM_LOG_LEVEL",
    "UCM_TOKEN",
    "UCM_TARGET",
    "UCM_CONNECTOR_STRICT",
    "UCM_EXIT_WITH_PARENT",
    "UCM_DAEMON_UID",
}


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Every setting of ``ucm-server``; see each field's help."""

    socket: Path = field(
        default_factory=default_socket_path,
        metadata=_help("Unix socket the daemon listens on (mode 0600, parent directory 0700)."),
    )
    listen: str = field(
        default="",
        metadata=_help("Also listen on TCP host:port. Needs tls_cert/tls_key, or insecure: true."),
    )
    insecure: bool = field(
        default=False, metadata=_help("Allow a TCP listener without TLS (logs a warning).")
    )
    allow_anonymous_tcp: bool = field(
        default=False,
        metadata=_help(
            "Let TCP peers in with neither a token (auth_tokens_file) nor a client certificate "
            "(tls_client_ca): they may read, write and delete the default tenant's blocks but never "
            "call Admin. Without it such a listener refuses to start. Logs a warning."
        ),
    )
    tls_cert: str = field(default="", metadata=_help("PEM server certificate for the TCP listener."))
    tls_key: str = field(default="", metadata=_help("PEM private key for tls_cert."))
    tls_client_ca: str = field(
        default="", metadata=_help("PEM CA bundle; when set, TCP clients must present a certificate.")
    )
    auth_tokens_file: str = field(
        default="",
        metadata=_help(
            "YAML file of client tokens (sha256), tenants, admin rights and quotas; "
            "empty = no tokens (the socket's 0600 mode is the access control)."
        ),
    )
    data_dir: Path = field(
        default_factory=default_data_dir,
        metadata=_help("State directory; the Posix tier defaults to <data_dir>/blocks."),
    )
    store_pipeline: str = field(
        default="Cache|Posix",
        metadata=_help(
            f"Tiers from fastest to slowest, '|'-separated; built in: {', '.join(BUILTIN_TIERS)}; "
            "also 'package.module:Class' or a name registered in the ucm.tiers entry points."
        ),
    )
    encrypt_tiers: str = field(
        default="",
        metadata=_help(
            "Tiers whose blocks are encrypted at rest per tenant (AES-256-GCM), '|'-separated, e.g. "
            "'Posix' or 'Posix|DS3FS'; never the Cache. Each tenant's key is the key_file its entry "
            "of auth_tokens_file names; blocks of tenants without one are stored in clear."
        ),
    )
    codec_tiers: str = field(
        default="",
        metadata=_help(
            "Tiers whose KV blocks are compressed at rest (codec), '|'-separated, e.g. 'Posix' or "
            "'Posix|DS3FS'; never the Cache. Off by default. Blocks already stored keep loading, "
            "either way round."
        ),
    )
    codec: str = field(
        default="fp8_e4m3",
        metadata=_help(
            "The codec of codec_tiers: fp8_e4m3 (2 bytes -> 1 per element, a power-of-two scale per "
            "16,384 elements; lossy, error <= 6.25% of a value or 2^-17 of its group's largest)."
        ),
    )
    codec_dtype: str = field(
        default="bfloat16",
        metadata=_help(
            "The element type of the KV blocks the codec encodes: bfloat16 or float16 (the daemon "
            "stores opaque bytes; set it to the model's KV cache dtype, and keep codec_tiers empty "
            "for any other)."
        ),
    )
    storage_backends: str = field(
        default="",
        metadata=_help(
            "Posix tier root directories, ':'-separated, blocks striped by key. Empty = <data_dir>/blocks."
        ),
    )
    cache_capacity: int = field(
        default=1 << 30, metadata=_help("Bytes of host memory for the Cache tier (e.g. '8GiB').", size=True)
    )
    cache_page_size: int = field(
        default=64 << 10,
        metadata=_help("Allocation unit of the Cache arena; a block uses whole pages.", size=True),
    )
    cache_prefault: bool = field(
        default=True,
        metadata=_help(
            "Fault the Cache arena's memory in after start-up, in a background thread at the lowest CPU "
            "priority, so storing a block never pays first-touch page faults (~8x a memcpy). The "
            "daemon's memory use reaches cache_capacity shortly after start."
        ),
    )
    cache_eviction: Literal["lru", "arc"] = field(
        default="lru",
        metadata=_help(
            "The Cache tier's eviction policy: lru (least recently used first) or arc (Adaptive "
            "Replacement Cache: blocks read again are kept apart from one-off ones, so a burst of long "
            "unique prompts does not flush shared prefixes; see benchmarks/eviction_bench.py). Pins and "
            "priorities apply on top of either."
        ),
    )
    admission_daemon: str = field(
        default="always",
        metadata=_help(
            "Admission policy at the daemon's door (a dumped block is stored at all): always, "
            "second-use (only a block used again within admission_window_s: a one-off prompt is never "
            "stored, a shared prefix from its second dump on) or tinylfu (only when its estimated "
            "frequency beats that of the Cache block it would evict), or package.module:Class. A "
            "refused block's Dump still reports it OK. See docs/operations.md, Admission."
        ),
    )
    admission_local: str = field(
        default="always",
        metadata=_help(
            "Admission policy from the Cache to the local tiers below it (Posix): always, second-use "
            "(a block is written to disk only once it is looked up or read again within "
            "admission_window_s; until then it lives in the Cache only), tinylfu (only when there is "
            "room or its estimated frequency beats that of the block the tier would evict), or "
            "package.module:Class. Fewer bytes written: less disk wear, and one-off prompts no "
            "longer evict shared prefixes (benchmarks/admission_bench.py)."
        ),
    )
    admission_shared: str = field(
        default="always",
        metadata=_help(
            "Admission policy to the shared tiers (DS3FS, Mooncake, S3): the choices of "
            "admission_local. A block reaches a tier only through the one above it."
        ),
    )
    admission_window_s: float = field(
        default=3600.0,
        metadata=_help("How long admission policies remember a use of a block (second-use's window)."),
    )
    admission_window_keys: int = field(
        default=1 << 20,
        metadata=_help(
            "Distinct blocks an admission window holds before it turns over early; sizes the policies' "
            "filters (about 16 bytes per block for second-use, 12 for tinylfu, per boundary)."
        ),
    )
    region_prefault: bool = field(
        default=True,
        metadata=_help(
            "Populate the daemon's page tables for client memory right after it is registered, in a "
            "background thread at the lowest CPU priority, so the first Load into a fresh vLLM "
            "process's KV cache runs at memcpy speed instead of paying a page fault per 4 KiB. Allocates "
            "nothing: memory with holes is left alone."
        ),
    )
    posix_capacity: int = field(
        default=0, metadata=_help("Bytes the Posix tier may hold before it evicts (0 = no limit).", size=True)
    )
    write_mode: Literal["write-back", "write-through"] = field(
        default="write-back",
        metadata=_help(
            "write-back: a dump completes in the top tier and flows down in the background; "
            "write-through: it completes only once in every tier."
        ),
    )
    durable: bool = field(
        default=True, metadata=_help("fsync block files and their directories before they become visible.")
    )
    posix_direct_io: bool = field(
        default=True,
        metadata=_help(
            "Write Posix block files of 256 KiB and more with O_DIRECT when the block's buffers and the "
            "filesystem allow it: flushing then skips the page cache and costs almost no CPU (smaller "
            "blocks are faster buffered). Off: always buffered."
        ),
    )
    posix_index_wait_s: float = field(
        default=0.2,
        metadata=_help(
            "Seconds the daemon waits at start for the Posix tier's index (from its clean-shutdown "
            "snapshot, or by reading block headers) before it serves; the rest is indexed in the "
            "background, and until then a Lookup may miss a block a Load still finds."
        ),
    )
    posix_snapshot_interval_s: float = field(
        default=60.0,
        metadata=_help(
            "Seconds between periodic snapshots of the Posix tier's index while the daemon runs "
            "(written off the event loop, only when the index changed). After kill -9 or a power "
            "loss the next start loads the newest one at once, then checks every block file's header "
            "in the background. 0: a snapshot only at clean shutdown (a crash then re-reads every header)."
        ),
    )
    posix_pack_max_block_bytes: int = field(
        default=0,
        metadata=_help(
            "Posix blocks of at most this many bytes are written into pack files when a dump batch has "
            "two or more of them: one file, one write and one rename per group of up to 64 blocks "
            "(8 MiB) instead of one file per block, so small blocks dump and load at file-system "
            "speed. A deleted or evicted block in a pack is marked dead on disk; the pack file is "
            "removed with its last live block, and until then its dead bytes count against "
            "posix_capacity. 0 (default): one file per block, as releases before packs; 65536 is a good "
            "value for per-layer or small blocks. At most 8 MiB.",
            size=True,
        ),
    )
    writeback_max_bytes: int = field(
        default=0,
        metadata=_help(
            "Bound of the write-back backlog: Cache bytes (whole pages) that may await their "
            "write-down at once; 0 = half of cache_capacity. The rest of the Cache stays evictable, "
            "so a write is never refused because every cached block awaits write-back.",
            size=True,
        ),
    )
    writeback_wait_s: float = field(
        default=1.0,
        metadata=_help(
            "Backpressure: how long a dump waits for room in a full write-back backlog before "
            "writeback_overflow decides (dumps then run at the lower tier's pace instead of a few "
            "stalling for seconds). A dump with wait_durable waits as long as it takes."
        ),
    )
    writeback_overflow: Literal["cache-only", "write-through"] = field(
        default="write-through",
        metadata=_help(
            "What a dump does when the write-back backlog stayed full for writeback_wait_s (a saturated "
            "node): cache-only keeps it in the Cache without writing it down (counted in "
            "writeback_skipped; never for wait_durable); write-through writes it to the lower tiers "
            "before the dump completes."
        ),
    )
    writeback_batch_blocks: int = field(
        default=4,
        metadata=_help(
            "Blocks one write-back flusher hands the lower tiers at once (one batch write: a tier with "
            "group commit pays one fsync for all of them). Flushers (io_threads / 2) x this many block "
            "writes run at once and share io_threads with the dumps and loads being answered."
        ),
    )
    io_threads: int = field(default=8, metadata=_help("Threads for disk and copy work."))
    max_batch_blocks: int = field(default=65536, metadata=_help("Most blocks one request may carry."))
    max_block_bytes: int = field(default=256 << 20, metadata=_help("Largest block accepted.", size=True))
    max_segments_per_block: int = field(
        default=4096,
        metadata=_help(
            "Most (region, offset, length) segments one block may be made of. vLLM sends one per "
            "layer (two where K and V sit apart), a few hundred at most; beyond it a Load/Dump is "
            "refused with RESOURCE_EXHAUSTED."
        ),
    )
    max_segments_per_request: int = field(
        default=1 << 20,
        metadata=_help(
            "Most segments one Load/Dump may carry in all (4,096 blocks of 256 segments); bounds "
            "the work of validating a request. Beyond it the request is refused with RESOURCE_EXHAUSTED."
        ),
    )
    staging_bytes: int = field(
        default=256 << 20,
        metadata=_help(
            "Daemon-owned memory that blocks read from lower tiers (and dumps the Cache does not "
            "hold) pass through, so nothing about a stored block is decided from bytes in client "
            "memory. Faulted in on first use; more concurrent traffic than this waits for it.",
            size=True,
        ),
    )
    reply_bytes: int = field(
        default=1 << 30,
        metadata=_help(
            "Block bytes the daemon holds at once, across all clients, for GetBlocks replies being "
            "sent (each reply holds its block until gRPC has sent it). A reply beyond it waits; a "
            "block larger than this is sent alone.",
            size=True,
        ),
    )
    max_sessions: int = field(
        default=1024, metadata=_help("Most sessions (attached clients) the daemon holds at once.")
    )
    max_sessions_per_peer: int = field(
        default=256,
        metadata=_help(
            "Most sessions one tenant (token) or one TCP peer address may hold at once; local "
            "clients without tokens share only max_sessions."
        ),
    )
    max_tasks_per_session: int = field(
        default=1024,
        metadata=_help(
            "Most Load/Dump/Prefetch tasks one session may have running or queued; more are "
            "refused with RESOURCE_EXHAUSTED until some finish."
        ),
    )
    pin_reserve: float = field(
        default=0.25,
        metadata=_help(
            "Share of each bounded tier (Cache; Posix with posix_capacity) that pins can never "
            "take, all principals together, counting the pinned blocks the tier must hold (in "
            "Cache|Posix: all of them in Posix, in the Cache only those not yet safe on disk): a "
            "pin past it is refused with RESOURCE_EXHAUSTED, so other principals' blocks always "
            "find room by evicting unpinned ones. 0 to 0.99."
        ),
    )
    pin_share: float = field(
        default=0.5,
        metadata=_help(
            "Share of each bounded tier one principal without a quota may pin (a tenant without "
            "quota, a token without a tenant, the local clients of a daemon without tokens), "
            "counted as pin_reserve is; a tenant with a quota pins within its quota. 0 to 1."
        ),
    )
    shared_lookup_ttl_s: float = field(
        default=2.0,
        metadata=_help(
            "How long a shared tier's lookup answer (present or absent) is reused; 0 = ask every "
            "time. A block another node deletes may still look present this long (its load then "
            "reports it missing)."
        ),
    )
    max_session_regions: int = field(
        default=4096,
        metadata=_help(
            "Most memory regions (host or GPU) one client session may have registered at once; "
            "RESOURCE_EXHAUSTED beyond."
        ),
    )
    max_session_region_bytes: int = field(
        default=1 << 40,
        metadata=_help(
            "Most bytes of memory one client session may have registered at once (e.g. '1TiB'); "
            "RESOURCE_EXHAUSTED beyond.",
            size=True,
        ),
    )
    max_pending_handovers: int = field(
        default=256,
        metadata=_help(
            "Most memfds handed over on the fd socket and not yet registered (each holds a file "
            "descriptor for up to 10 s); one process may hold a quarter of them, and when all are taken a "
            "newcomer takes the place of the oldest of the process (or uid) holding the most."
        ),
    )
    max_retention_rules: int = field(
        default=1_000_000,
        metadata=_help(
            "Most blocks with a retention rule (pin, TTL or priority) the daemon holds, all clients "
            "together; a change that would add more is refused with RESOURCE_EXHAUSTED. retention.json "
            "and the daemon's memory stay proportional to the rules in force (about 150 bytes each on "
            "disk)."
        ),
    )
    task_retention_s: float = field(
        default=300.0, metadata=_help("How long a finished task stays available to Wait/Check.")
    )
    heartbeat_interval_s: float = field(
        default=5.0, metadata=_help("Interval of session heartbeats sent to clients.")
    )
    metrics_address: str = field(
        default="127.0.0.1:9464",
        metadata=_help("host:port of the Prometheus endpoint; 'off' disables it, port 0 picks a free one."),
    )
    log_level: str = field(
        default="INFO",
        metadata=_help("DEBUG, INFO, WARNING or ERROR (env UNIFIED_CACHE_LOG_LEVEL or UCM_LOG_LEVEL)."),
    )
    log_format: Literal["text", "json"] = field(default="text", metadata=_help("Log line format."))
    tier_settings: dict[str, dict[str, Any]] = field(
        default_factory=dict,
        metadata=_help("Per-tier settings for shared tiers, keyed by tier name (e.g. {S3: {bucket: ...}})."),
    )
    kv_events_endpoint: str = field(
        default="",
        metadata=_help(
            "Publish what every tier holds as vLLM KV events (BlockStored / BlockRemoved / "
            "AllBlocksCleared, msgpack over ZeroMQ PUB) on this address: local = "
            "ipc://<socket directory>/kv-events.pub (only the daemon's uid can connect), "
            "ipc:///path or tcp://*:5557 binds, tcp://host:port connects; empty = off. Who sees "
            "which tenant's events: docs/security.md."
        ),
    )
    kv_events_replay_endpoint: str = field(
        default="",
        metadata=_help(
            "ZeroMQ ROUTER address for replay: missed batches from the ring, or a snapshot of the "
            "whole index for a subscriber that joins late or fell too far behind; local = "
            "ipc://<socket directory>/kv-events.replay; empty = off."
        ),
    )
    kv_events_heartbeat_s: float = field(
        default=1.0,
        metadata=_help(
            "Every this many seconds without a batch, the last batch's number is sent again with no "
            "events, so a subscriber that missed batches (a daemon restarted while it stayed "
            "connected) sees the gap and repairs it through the replay socket; 0 = off."
        ),
    )
    kv_events_curve_secret_key_file: str = field(
        default="",
        metadata=_help(
            "The daemon's ZeroMQ CURVE secret key (a 0600 file of 40 Z85 characters, python -m "
            "ucm_server.kv_events.keygen makes one): the event sockets then encrypt and admit only "
            "the subscribers of kv_events_subscribers_file, each seeing its own tenant's events."
        ),
    )
    kv_events_subscribers_file: str = field(
        default="",
        metadata=_help(
            "YAML list of the subscribers' CURVE public keys and what each sees "
            "(subscribers: [{public_key: ..., tenant: NAME}] or {public_key: ..., all: true}); "
            "needs kv_events_curve_secret_key_file."
        ),
    )
    kv_events_allow_open_tcp: bool = field(
        default=False,
        metadata=_help(
            "Let a KV event endpoint bind every interface (tcp://*:PORT) without CURVE: anyone who "
            "reaches the port reads the block hashes of the namespaces no tenant owns. Off: refused."
        ),
    )
    kv_events_persistent_medium: str = field(
        default="STORAGE",
        metadata=_help(
            "The medium KV events name for a persistent tier of this node (Posix): vLLM's "
            "STORAGE; DISK is what earlier releases sent."
        ),
    )
    kv_events_shared_medium: str = field(
        default="SHARED",
        metadata=_help("The medium KV events name for a tier other nodes write too (DS3FS, Mooncake, S3)."),
    )
    kv_events_topic: str = field(
        default="",
        metadata=_help("Topic frame of every KV event batch; empty = kv@<kv_events_node>@ucm."),
    )
    kv_events_node: str = field(
        default="",
        metadata=_help("This daemon's node identity in the KV events topic; empty = the host name."),
    )
    kv_events_hash_format: Literal["int64", "bytes"] = field(
        default="int64",
        metadata=_help(
            "How KV events carry block hashes, to match vLLM's own events: int64 = the key's low 64 "
            "bits as an unsigned integer (vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1); "
            "bytes = the whole 32-byte key (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."
        ),
    )
    kv_events_buffer_batches: int = field(
        default=10000, metadata=_help("Past KV event batches kept for replay before a snapshot is needed.")
    )
    gpu: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata=_help(
            "GPU regions (CUDA IPC, needs cupy): auto = start the GPU path and pin the Cache arena at the "
            "first GPU client; on = at start-up, failing if there is no cupy or no device; off = refuse them."
        ),
    )
    tracing_exporter: Literal["off", "otlp"] = field(
        default="off",
        metadata=_help(
            "OpenTelemetry traces of the daemon's calls, tasks and tier reads and writes: off, or otlp "
            "(OTLP over HTTP/protobuf to tracing_endpoint). Off costs nothing (docs/operations.md, Tracing)."
        ),
    )
    tracing_endpoint: str = field(
        default="",
        metadata=_help(
            "OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces; empty = "
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else localhost:4318."
        ),
    )
    tracing_sample_ratio: float = field(
        default=1.0,
        metadata=_help(
            "Fraction (0 to 1) of calls from untraced clients that are recorded; a call whose caller "
            "records its trace (a connector with tracing on) is always recorded."
        ),
    )

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


FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}
_HINTS = get_type_hints(ServerConfig)


def _coerce(key: str, raw: object, source: str) -> Any:
    """Turn a YAML/env/flag value into the field's type, naming key and source on failure."""
    where = f"{key} (from {source})"
    value = coerce(_HINTS[key], raw, where, size=bool(FIELDS[key].metadata.get("size")), source="text")
    if key == "tier_settings":
        bad = [k for k, v in value.items() if not isinstance(k, str) or not isinstance(v, dict)]
        if bad:
            raise ConfigError(f"{where}: expected tier name -> mapping of settings, got entry {bad[0]!r}")
    return value


def _from_mapping(values: Mapping[str, object], source: str) -> dict[str, Any]:
    for key in values:
        if key not in FIELDS:
            raise ConfigError(f"{source}: unknown key {key!r}; known: {', '.join(FIELDS)}")
    return {key: _coerce(key, raw, source) for key, raw in values.items()}


def read_yaml(path: Path) -> dict[str, Any]:
    doc = read_yaml_mapping(path, "config file")
    if "ucm_connectors" in doc:  # seed 001 format: take the first connector's config
        connectors = doc["ucm_connectors"]
        if not isinstance(connectors, list) or not connectors or not isinstance(connectors[0], dict):
            raise ConfigError(f"config file {path}: ucm_connectors must be a non-empty list of mappings")
        inner = connectors[0].get("ucm_connector_config", {})
        if not isinstance(inner, dict):
            raise ConfigError(f"config file {path}: ucm_connector_config must be a mapping")
        return _from_mapping(inner, f"{path} (ucm_connectors[0].ucm_connector_config)")
    return _from_mapping(doc, str(path))


def read_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """Known ``UCM_*`` settings, and the names of unknown ``UCM_*`` variables (to warn about)."""
    out: dict[str, Any] = {}
    unknown: list[str] = []
    for name, raw in environ.items():
        if not name.startswith("UCM_") or name in _CLIENT_ENV:
            continue
        key = name[4:].lower()
        if key in FIELDS:
            out[key] = _coerce(key, raw, f"environment {name}")
        else:
            unknown.append(name)
    level = environ.get("UNIFIED_CACHE_LOG_LEVEL") or environ.get("UCM_LOG_LEVEL")
    if level:
        out["log_level"] = level
    return out, unknown


def load_config(
    config_file: Path | None = None,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[ServerConfig, list[str]]:
    """Defaults < YAML < env < ``overrides`` (command-line flags). Returns the config and warnings."""
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(read_yaml(config_file))
    env_values, unknown_env = read_env(os.environ if environ is None else environ)
    values.update(env_values)
    if overrides:
        values.update(_from_mapping({k: v for k, v in overrides.items() if v is not None}, "command line"))
    warnings = [f"ignoring unknown environment variable {n} (not a ucm-server setting)" for n in unknown_env]
    return ServerConfig(**values).validate(), warnings


def describe(config: ServerConfig) -> dict[str, Any]:
    """The effective configuration as plain data (``--print-config``)."""
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = getattr(config, name)
        out[name] = str(value) if isinstance(value, Path) else value
    return out
