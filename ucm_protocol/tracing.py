"""What the connector's and the daemon's traces call things, in one place both sides import.

The spans of one request cross a process boundary (the connector's load or save, then the daemon's
task and tier reads), so a query in a tracing backend (``ucm.tier.served = "Posix"``,
``ucm.request_id = "cmpl-42"``) must find the same attribute on both sides. Only names live here:
this module imports nothing from OpenTelemetry, so importing it costs nothing when tracing is off.

Context travels from the connector to the daemon in the gRPC metadata of each call, as the W3C
Trace Context ``traceparent`` (and ``tracestate``) entries; the vLLM request id travels beside it as
W3C Baggage (``baggage: ucm.request_id=...``), so the daemon's task span names the request too.
"""

from __future__ import annotations

from typing import Final, Literal

EXPORTERS: Final = ("off", "otlp")
"""``tracing_exporter`` values of the daemon: ``off`` (the default) or OTLP over HTTP/protobuf."""

TracingExporter = Literal["off", "otlp"]

CONNECTOR_EXPORTERS: Final = ("off", "otlp", "global")
"""The connector's ``tracing_exporter`` values: ``global`` uses the tracer provider the process
already has (vLLM's own, when it runs with ``--otlp-traces-endpoint``)."""

ConnectorTracingExporter = Literal["off", "otlp", "global"]

TRACEPARENT: Final = "traceparent"
"""The W3C Trace Context header, as a gRPC metadata key (lower case, as gRPC requires)."""

BAGGAGE: Final = "baggage"

# -- attribute names ------------------------------------------------------------------------------------
REQUEST_ID: Final = "ucm.request_id"
"""The vLLM request id of a connector span (and, through baggage, of the daemon's task span)."""
REQUEST_IDS: Final = "ucm.request_ids"
"""Every request of a transfer that moves several requests' blocks in one task (a step's saves)."""
BLOCKS: Final = "ucm.blocks"
"""Blocks asked for: keys looked up, blocks to load or dump."""
BYTES: Final = "ucm.bytes"
"""Bytes moved (loaded, stored, read from or written to a tier)."""
HITS: Final = "ucm.hits"
"""Blocks found: stored keys of a lookup, blocks a load or a tier read returned."""
MISSES: Final = "ucm.misses"
"""Blocks not found (a lookup's absent keys, a load's missing blocks)."""
FAILED: Final = "ucm.failed"
"""Blocks that failed (corrupt, I/O error, cancelled)."""
HIT: Final = "ucm.hit"
"""True when every block asked for was found (a full hit), False otherwise."""
HIT_PREFIX: Final = "ucm.hit_prefix"
"""Leading blocks of a lookup that are all stored (what vLLM can skip computing)."""
TIER: Final = "ucm.tier"
"""The tier a tier span is about (``Cache``, ``Posix``, ``DS3FS``...)."""
TIER_KIND: Final = "ucm.tier.kind"
TIER_SERVED: Final = "ucm.tier.served"
"""The tiers that returned a load's blocks, fastest first (``["Cache"]``, ``["Cache", "Posix"]``)."""
TIER_SERVED_BLOCKS: Final = "ucm.tier.served_blocks"
"""Blocks each tier of ``ucm.tier.served`` returned, in the same order."""
TASK_ID: Final = "ucm.task.id"
TASK_KIND: Final = "ucm.task.kind"
QUEUED_S: Final = "ucm.task.queued_s"
"""Seconds a task waited for a free slot before its first copy."""
STATE: Final = "ucm.task.state"
"""``done`` or ``cancelled``."""
PARTS: Final = "ucm.parts"
"""Daemon tasks of one connector transfer (one per layer with ``use_layerwise``)."""
ASYNC: Final = "ucm.async"
"""A load vLLM runs between steps (``load_async``) rather than before the step's forward."""
METHOD: Final = "rpc.method"
SERVICE: Final = "rpc.service"
SYSTEM: Final = "rpc.system"
STATUS_CODE: Final = "rpc.grpc.status_code"
