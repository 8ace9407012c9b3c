"""Cold KV in the daemon: what the scheduler and the workers agree on (config, step metadata, keys).

ESA's point upstream is that the blocks a decode step does not select need not stay next to the
kernel. For a long request in sparse mode the scheduler (:mod:`ucm_client.sparse.coldkv.scheduler`)
orders its *cold* blocks — every full block after the initial window and before the local window —
dumped to ``ucm-server``, one object per (block, layer); once the daemon holds them all it frees those
blocks in vLLM's block pool the way the sliding-window manager frees out-of-window blocks (null block
in the request's list) and gives the request a few *scratch* blocks instead. A worker
(:mod:`ucm_client.sparse.coldkv.worker`) then loads, before each layer's attention, the cold blocks
ESA selected into the scratch blocks and points the shortened block table at them.

Only this module's dataclasses cross from the scheduler to the workers (inside the sparse
connector's metadata), so nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ucm_client.sparse.config import BlockBudget
from ucm_client.sparse.errors import SparseInputError
from ucm_client.types import key_digest, namespace_id

__all__ = [
    "ColdDump",
    "ColdKVConfig",
    "ColdKVStepMeta",
    "ColdRelease",
    "ColdStepPlanner",
    "SupportsColdKV",
    "cold_block_key",
]


@dataclass(frozen=True, slots=True)
class ColdKVConfig:
    """``kv_connector_extra_config["cold_kv"]``: where cold blocks go and which requests qualify."""

    target: str
    """The ``ucm-server`` to dump to and load from (socket path or ``host:port``)."""
    min_cold_blocks: int = 4
    """A request is offloaded only if it has at least this many cold blocks (short ones stay)."""
    namespace: str = "ucm-cold-kv"
    """Namespace label; the engine adds a random nonce so two engines never read each other's blocks."""
    timeout_s: float = 30.0
    """How long a worker waits for one dump or load task before the step fails."""
    prefetch: bool = True
    """Send layer L+1's likely cold blocks (those layer L selected) while layer L runs, so the blocks
    both layers pick are already in the worker when L+1's selection asks for them."""

    def __post_init__(self) -> None:
        if not self.target:
            raise SparseInputError("cold_kv.target must name a ucm-server (socket path or host:port)")
        if self.min_cold_blocks < 1:
            raise SparseInputError(f"cold_kv.min_cold_blocks must be >= 1, got {self.min_cold_blocks}")
        if self.timeout_s <= 0:
            raise SparseInputError(f"cold_kv.timeout_s must be > 0, got {self.timeout_s}")
        if not isinstance(self.prefetch, bool):
            raise SparseInputError(f"cold_kv.prefetch must be true or false, got {self.prefetch!r}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ColdKVConfig | None:
        """The ``cold_kv`` entry of the connector's extra config (``None``: cold KV is off)."""
        raw = (extra or {}).get("cold_kv")
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise SparseInputError(f"cold_kv must be a mapping, got {type(raw).__name__}")
        unknown = set(raw) - {"target", "min_cold_blocks", "namespace", "timeout_s", "prefetch"}
        if unknown:
            raise SparseInputError(f"unknown cold_kv settings {sorted(unknown)}")
        if "target" not in raw:
            raise SparseInputError("cold_kv.target is required (the ucm-server's socket path or host:port)")
        return cls(**dict(raw))

    def namespace_bytes(self, nonce: str) -> bytes:
        return namespace_id(cold_kv=self.namespace, engine=nonce)


@dataclass(frozen=True, slots=True)
class ColdDump:
    """Dump these blocks of a request (all layers) before this step's forward.

    Their KV was written by earlier steps and no step writes it again (full blocks), so the copy is
    final; the scheduler frees them only after the daemon reports every object present.
    """

    request_id: str
    logical: tuple[int, ...]
    physical: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ColdRelease:
    """From this step on, blocks ``[first, last)`` of the request are in the daemon only.

    Their physical ids (still in the worker's block table) may belong to another request now; the
    request's ``scratch`` blocks are where its selected cold blocks are loaded instead.
    """

    request_id: str
    first: int
    last: int
    scratch: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ColdKVStepMeta:
    """One step's cold-KV orders for the workers."""

    nonce: str
    dumps: tuple[ColdDump, ...] = ()
    releases: tuple[ColdRelease, ...] = ()
    forget: frozenset[str] = field(default_factory=frozenset)
    """Requests finished or preempted since the last step: drop their cold state."""


def cold_block_key(nonce: str, request_id: str, layer_idx: int, block: int) -> bytes:
    """The daemon key of one layer of one logical block of one request of one engine."""
    return key_digest(nonce, request_id, "cold", layer_idx, block)


class ColdStepPlanner(Protocol):
    """The scheduler half, as the connector sees it: one step's orders per ``build_connector_meta``."""

    def step_meta(self, scheduler_output: Any) -> ColdKVStepMeta: ...


@runtime_checkable
class SupportsColdKV(Protocol):
    """A connector that carries cold-KV orders to the workers (``UCMConnector``, ``UcmSparseConnector``)."""

    @property
    def cold_config(self) -> ColdKVConfig | None: ...

    def sparse_budget(self) -> BlockBudget | None: ...

    def attach_cold_planner(self, planner: ColdStepPlanner) -> None: ...
