"""Every setting of ``ucm-server``: its name, type, default and help, in one typed dataclass.

Every field documents itself (``help`` metadata; ``size=True`` where a value is a byte size), which is
what ``ucm-server --help``, ``--print-config`` and docs/configuration.md are generated from. How the
settings are checked and what follows from them is :mod:`ucm_server.config`; where their values come
from is :mod:`ucm_server.config_sources`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ucm_protocol.paths import default_data_dir, default_socket_path
from ucm_server.store.registry import BUILTIN_TIERS

__all__ = ["FIELDS", "ServerSettings"]


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Every setting of ``ucm-server``, as declared; :class:`~ucm_server.config.ServerConfig` is this,
    checked."""

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
            "Fault the Cache arena's memory in after start-up, in a background thread (in small steps, "
            "so the daemon's own memory mappings never wait long for it), so storing a block never pays "
            "first-touch page faults (~8x a memcpy). The daemon's memory use reaches cache_capacity "
            "shortly after start."
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
            "background thread (in small steps), so the first Load into a fresh vLLM "
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
        default=64 << 10,
        metadata=_help(
            "Posix blocks of at most this many bytes are written into pack files when a dump batch has "
            "two or more of them: one file, one write and one rename per group of up to 64 blocks "
            "(8 MiB) instead of one file per block, so small blocks dump and load at file-system "
            "speed. A deleted or evicted block in a pack is marked dead on disk; the pack file is "
            "removed with its last live block, and until then its dead bytes count against "
            "posix_capacity. Default 64 KiB (measured: packs win at 4 and 64 KiB, lose at 1 MiB); "
            "0: one file per block, the layout of releases before packs (a release without packs does "
            "not see packed blocks, see the operations guide on downgrades). At most 8 MiB.",
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
    io_background_hold_s: float = field(
        default=0.025,
        metadata=_help(
            "Longest a background job (a write-back's block writes and syncs, a dump's copy) is held "
            "between two of its blocks while Loads read, before one goes on (background work keeps "
            "at least that pace under a stream of Loads). 0: background work is held only before "
            "it starts, never mid-job (a Load then shares the disk with the writes already running)."
        ),
    )
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
    dataplane: bool = field(
        default=True,
        metadata=_help(
            "Local clients answer Lookup from a table the daemon shares with them read-only, and send "
            "Load/Dump through a per-session ring in shared memory, without a gRPC call (socket "
            "<socket>.dp). Needs the compiled helper (built at install when gcc and the Python headers "
            "are there); without it, or off, clients use gRPC as before."
        ),
    )
    dataplane_ring_bytes: int = field(
        default=8 << 20,
        metadata=_help(
            "Shared memory for one session's Load/Dump request bodies in its data-plane ring; a "
            "request larger than this goes by gRPC.",
            size=True,
        ),
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


FIELDS = {f.name: f for f in dataclasses.fields(ServerSettings)}
"""Every setting by name, in declaration order (flags, docs and ``--print-config`` follow it)."""
