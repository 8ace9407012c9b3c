"""The connector's settings: one typed dataclass, merged from four sources in upstream UCM's order.

Priority, highest first (as upstream UCM orders them, "配置优先级"): environment (``UCM_<FIELD>``) >
``kv_connector_extra_config`` > the YAML file named by ``UCM_CONFIG_FILE`` > built-in defaults. The
defaults alone work: no extra config at all means "talk to the daemon at its default socket".

Unknown keys and bad values are errors that name the key and where it came from; nothing is silently
ignored. Upstream UCM's YAML also carries daemon-side settings (``ucm_connectors`` with
``store_pipeline``...): those configure ``ucm-server``, so the connector accepts them and says once, in
a warning, that they have no effect here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_type_hints

from ucm_client import tracing
from ucm_protocol.errors import ConfigError
from ucm_protocol.settings import coerce, load_fields, read_yaml_mapping
from ucm_protocol.tracing import ConnectorTracingExporter

__all__ = ["ConfigError", "ConnectorConfig", "load_config"]

CONFIG_FILE_ENV = "UCM_CONFIG_FILE"
# Under vLLM's logger tree, so the connector's messages get vLLM's format and VLLM_LOGGING_LEVEL.
LOGGER_NAME = "vllm.ucm_connector"
_CONFIG_FILE_KEYS = ("UCM_CONFIG_FILE", "config_file")

WeightFingerprint = Literal["sampled", "full", "off"]
LoadFailurePolicy = Literal["recompute", "vllm"]


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Everything the connector can be told. Each field's docstring says why it exists."""

    target: str | None = None
    """Daemon address: a socket path, ``unix:///path`` or ``host:port``. None = the daemon's default
    socket (``$UCM_SOCKET``, else the per-user runtime path), so a plain ``ucm-server`` just works."""

    model_id: str | None = None
    """Replaces (model path or name + weight fingerprint) in the namespace. For deployments that
    know their model identity better than a file fingerprint does (e.g. a registry digest)."""

    weight_fingerprint: WeightFingerprint = "sampled"
    """How weights are fingerprinted for the namespace: ``sampled`` hashes each weight file's size,
    head and tail (milliseconds, catches any re-trained or re-quantized checkpoint), ``full`` hashes
    every byte (slow on big models), ``off`` trusts the path or name plus revision alone."""

    zero_copy: bool = True
    """On CPU, put vLLM's KV cache itself in shared memory so the daemon copies straight into the
    pages vLLM computes on. Off (or on GPU) blocks go through a staging buffer instead."""

    staging_buffer_gib: float = 1.0
    """Size of the shared-memory staging buffer used when zero copy is not possible; loads and
    saves that do not fit at the moment are skipped (recomputed / not stored), never blocked on."""

    enable_load: bool = True
    """Serve prefix hits from the daemon. Off = a write-only cache (e.g. a warm-up job)."""

    enable_save: bool = True
    """Store newly computed full blocks in the daemon. Off = a read-only consumer."""

    load_async: bool = False
    """Load hits between scheduler steps (vLLM's async-load path) instead of before this step's
    forward. Keeps a long load from stalling a batch of running requests, at the cost of one extra
    step of latency for the loading request."""

    pd_wait_timeout_s: float = 30.0
    """Prefill/decode disaggregation (``kv_role: kv_consumer``): how long a decode request whose
    prefill promised blocks (``kv_transfer_params``) waits for them to be visible in the daemon
    before it takes what is there and recomputes the rest."""

    prefetch_on_lookup: bool = True
    """When the scheduler's lookup finds a hit, ask the daemon to promote it into its Cache at once
    (``Prefetch``), so blocks only on Posix or a shared tier are read while vLLM schedules, and the
    worker's load reads memory. Off: the load reads the lower tier itself."""

    load_timeout_s: float = 30.0
    """A load not done in this time is cancelled and its blocks recomputed."""

    save_timeout_s: float = 60.0
    """Longest a finished request's blocks are held back from vLLM's free list waiting for a save."""

    connect_timeout_s: float = 2.0
    """How long one connection attempt to the daemon may take."""

    rpc_timeout_s: float = 10.0
    """Longest one control call (lookup, submit, check) may take before the daemon counts as down;
    bounds how long a hung daemon can stall vLLM's scheduler loop."""

    reconnect_interval_s: float = 5.0
    """After the daemon was found down, wait this long before trying again (not every step)."""

    load_failure_policy: LoadFailurePolicy = "recompute"
    """``recompute``: a failed block load is recomputed by vLLM (the connector sets vLLM's
    ``kv_load_failure_policy`` accordingly, since a cache miss must never fail a request).
    ``vllm``: leave vLLM's own ``kv_load_failure_policy`` untouched."""

    allow_unsupported_vllm: bool = False
    """Run on a vLLM version this connector was not checked against (0.32, 0.33)."""

    allow_unstable_hashes: bool = False
    """Accept a block-hash setting that differs between processes (xxhash without
    ``PYTHONHASHSEED``): stored blocks will then never be hit by another process."""

    use_layerwise: bool = False
    """Store each block as one object per attention layer, and load layer by layer: all layers'
    loads start before the forward, and each attention layer waits only for its own, so the copy of
    layer L+1 overlaps the compute of layer L; each layer's dump starts right after that layer has
    written its KV. Needs zero copy (``zero_copy: true``; the staging buffer moves whole blocks).
    Its blocks live in their own namespace: a whole-block store never hits for it, nor it for one."""

    load_only_first_rank: bool = False
    """Seed option where rank 0 loads for everyone. Only ``false`` is supported: each TP rank loads
    its own shard, and lookups check every rank's shard."""

    kv_events_endpoint: str | None = None
    """The daemon's KV events address (its ``kv_events_endpoint``, e.g. ``tcp://127.0.0.1:5557`` or
    ``ipc:///run/ucm/events``). With vLLM's ``kv_events_config`` on, the scheduler subscribes and
    ``take_events`` forwards the daemon's tiers (CPU / DISK / SHARED) through vLLM's own publisher,
    so one stream carries GPU and UCM blocks. None: only vLLM's own GPU events."""

    kv_events_replay_endpoint: str | None = None
    """The daemon's ``kv_events_replay_endpoint``: the forwarder starts from a snapshot and repairs
    gaps through it. None: forwarding starts from whatever is published after vLLM starts."""

    tracing_exporter: ConnectorTracingExporter = "off"
    """OpenTelemetry traces of the connector's lookups, loads and saves, each joined by the daemon's
    spans for it: ``off``; ``otlp`` (OTLP over HTTP/protobuf to ``tracing_endpoint``, else to the
    standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``); ``global`` (the
    tracer provider the process already has: vLLM's own with ``--otlp-traces-endpoint``)."""

    tracing_endpoint: str | None = None
    """OTLP/HTTP traces URL for ``tracing_exporter: otlp``, e.g. ``http://collector:4318/v1/traces``."""

    tracing_sample_ratio: float = 1.0
    """Fraction (0 to 1] of requests whose connector spans are recorded (and so the daemon's for
    them: the daemon records what its caller records)."""

    ucm_connectors: tuple[Mapping[str, Any], ...] = ()
    """Seed store list (``store_pipeline``, ``storage_backends``...): daemon settings, not ours."""

    ucm_sparse_config: Mapping[str, Any] = field(default_factory=dict)
    """Sparse-attention algorithms and their settings, read by ``ucm_client.sparse``. Present here (or
    in ``$UCM_SPARSE_CONFIG``), it makes this connector carry sparse attention's scheduler → worker
    channel too: prefix storage plus sparse attention is this one connector."""

    cold_kv: Mapping[str, Any] = field(default_factory=dict)
    """Cold KV (``ucm_client.sparse.coldkv``): a long sparse request's unselected blocks go to
    ``ucm-server`` and leave vLLM's pool (``target`` required; needs ``scheduler_cls`` =
    ``ucm_client.sparse.coldkv_scheduler.ColdKVScheduler``). Empty: off."""

    metrics_config_path: str | None = None
    """Seed option; connector metrics go through vLLM's connector stats instead."""

    def daemon_side_keys(self) -> list[str]:
        """Settings present in this config that only ``ucm-server`` acts on (for one warning)."""
        keys: list[str] = []
        for entry in self.ucm_connectors:
            name = entry.get("ucm_connector_name", "?")
            sub = entry.get("ucm_connector_config", {})
            keys.extend(f"ucm_connectors[{name}].{k}" for k in sub)
        if self.metrics_config_path is not None:
            keys.append("metrics_config_path")
        return keys


_FIELDS = {f.name: f for f in dataclasses.fields(ConnectorConfig)}
_HINTS = get_type_hints(ConnectorConfig)
_ENV_ALIASES = {"UCM_SOCKET": "target", "UCM_TARGET": "target"}
_STRUCTURED = ("ucm_sparse_config", "cold_kv")
"""Mapping settings whose ``None`` (an empty YAML section) means empty."""
_OPTIONAL_STRINGS = (
    "target",
    "model_id",
    "metrics_config_path",
    "kv_events_endpoint",
    "kv_events_replay_endpoint",
    "tracing_endpoint",
)


def _settle(name: str, value: Any, where: str) -> Any:
    """What the connector adds to the loader's type rules: times and sizes are positive, an empty
    string means "not set" for optional strings."""
    if _HINTS[name] is float and value <= 0:
        raise ConfigError(f"{where}: expected a positive number, got {value!r}")
    if name in _OPTIONAL_STRINGS:
        return value or None
    return value


def _coerce(name: str, value: Any, source: str) -> Any:
    """Convert ``value`` to the type of field ``name`` (strings from env or YAML are parsed)."""
    where = f"{source}: {name}"
    if name in _STRUCTURED and value is None:
        return {}
    return _settle(name, coerce(_HINTS[name], value, where, source="structured"), where)


def _layer(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Validate one source's keys and values."""
    raw = {k: ({} if k in _STRUCTURED and v is None else v) for k, v in raw.items()}
    values = load_fields(
        ConnectorConfig,
        raw,
        source,
        at=lambda key: f"{source}: {key}",
        source="structured",
        skip=_CONFIG_FILE_KEYS,
        required=False,
    )
    return {k: _settle(k, v, f"{source}: {k}") for k, v in values.items()}


def _env_layer(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for var, value in environ.items():
        if var in _ENV_ALIASES:
            name = _ENV_ALIASES[var]
        elif var.startswith("UCM_") and var[4:].lower() in _FIELDS:
            name = var[4:].lower()
        else:
            continue
        if name in ("ucm_connectors", *_STRUCTURED):
            raise ConfigError(f"environment: {var}: structured settings belong in {CONFIG_FILE_ENV}")
        out[name] = _coerce(name, value, f"environment {var}")
    if "UCM_TARGET" in environ and "UCM_SOCKET" in environ:
        out["target"] = _coerce("target", environ["UCM_TARGET"], "environment UCM_TARGET")
    return out


def _yaml_layer(path: Path) -> dict[str, Any]:
    return _layer(read_yaml_mapping(path, "config file"), f"config file {path}")


def _check(config: ConnectorConfig) -> ConnectorConfig:
    if config.use_layerwise and not config.zero_copy:
        raise ConfigError(
            "use_layerwise: true needs zero_copy: true: the staging buffer used with zero_copy: false "
            "moves whole blocks only (set one of them the other way)"
        )
    tracing.check_settings(config)
    if config.load_only_first_rank:
        raise ConfigError(
            "load_only_first_rank: true is not supported by UCMConnector: every TP rank loads its "
            "own shard (set it to false)"
        )
    return config


def load_config(
    extra_config: Mapping[str, Any] | None,
    environ: Mapping[str, str] | None = None,
) -> ConnectorConfig:
    """Merge defaults < YAML < ``extra_config`` < environment into a validated config.

    The YAML path comes from ``$UCM_CONFIG_FILE``, else from ``UCM_CONFIG_FILE`` (or
    ``config_file``) inside ``extra_config``, as in upstream UCM's deployment examples.
    """
    env = os.environ if environ is None else environ
    extra = dict(extra_config or {})
    yaml_path = env.get(CONFIG_FILE_ENV) or next((extra[k] for k in _CONFIG_FILE_KEYS if extra.get(k)), None)
    merged: dict[str, Any] = {}
    if yaml_path:
        merged.update(_yaml_layer(Path(str(yaml_path)).expanduser()))
    merged.update(_layer(extra, "kv_connector_extra_config"))
    merged.update(_env_layer(env))
    return _check(ConnectorConfig(**merged))
